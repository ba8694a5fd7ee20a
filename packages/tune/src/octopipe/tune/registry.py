"""The schedule registry: every schedule octopipe knows, in one typed, immutable table.

An entry names a schedule, says where its stages go (a :class:`Placement`
value: one stage per rank, interleaved chunks, or the V), gives its generator
(``generator(num_ranks, num_microbatches, *, layer_names=None) -> Plan``),
whether its backward is split into I and W, and torch.distributed.pipelining's
class for it when torch has one. The tuner (``tune``, ``tune_mesh``), the
closed loop (``retune``), ``octopipe plan show --example`` and the torch
interop (``octopipe.execute.runtime.interop``) all read it; there is no other table.

**Adding a schedule** is adding one :class:`ScheduleEntry` to
:data:`DEFAULT_SCHEDULES` below (or, without editing octopipe,
``DEFAULT_SCHEDULES.with_entry(entry)`` passed as ``registry=`` /
``TuneConfig(registry=...)``). The tuner then searches it on its placement
family, the closed loop re-schedules with it where the running plan's
placement is its own, and the CLI shows it.

Entries whose ``generator`` is None (torch's ``ScheduleLoopedBFS`` and
``ScheduleInterleavedZeroBubble`` on two stages per rank) exist for the torch
interop only: their order comes from torch itself, so the tuner, the closed
loop and the CLI never offer them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from octopipe.plan.v1 import plan_pb2
from octopipe.tune.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2
from octopipe.tune.vshape import dualpipe_v, v_half, v_min, zb_v

__all__ = [
    "DEFAULT_SCHEDULES",
    "RESERVED_NAMES",
    "Placement",
    "PlacementKind",
    "ScheduleEntry",
    "ScheduleGenerator",
    "ScheduleRegistry",
]

PlacementKind = Literal["linear", "interleaved", "v"]
#: names the tuner and the closed loop use for plans that are not registry entries
RESERVED_NAMES = frozenset({"list", "list-zb", "current"})
_KINDS: tuple[PlacementKind, ...] = ("linear", "interleaved", "v")  # simplest first


@dataclass(frozen=True)
class Placement:
    """Where a schedule's stages go: ``stages_per_rank`` stages on each of p ranks.

    ``linear``: stage s on rank s. ``interleaved`` (``chunks`` >= 2): stage s
    on rank s % p. ``v``: stages s and 2p-1-s on rank s. Build one with
    :meth:`linear`, :meth:`interleaved` or :meth:`v`.
    """

    kind: PlacementKind
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown placement kind {self.kind!r}: use 'linear', 'interleaved' or 'v'")
        expected = {"linear": 1, "v": 2}.get(self.kind)
        if expected is not None and self.chunks != expected:
            raise ValueError(f"a {self.kind} placement has {expected} stage(s) per rank, got chunks={self.chunks}")
        if self.kind == "interleaved" and self.chunks < 2:
            raise ValueError(f"an interleaved placement needs chunks >= 2 (1 is linear), got {self.chunks}")

    @classmethod
    def linear(cls) -> Placement:
        return cls("linear")

    @classmethod
    def interleaved(cls, chunks: int) -> Placement:
        return cls("interleaved", chunks)

    @classmethod
    def v(cls) -> Placement:
        return cls("v", 2)

    @property
    def stages_per_rank(self) -> int:
        return self.chunks

    @property
    def label(self) -> str:
        """The placement family's name in reports, JSON and ``TuneConfig.families``: ``linear``,
        ``interleaved-<chunks>`` or ``v``."""
        return f"interleaved-{self.chunks}" if self.kind == "interleaved" else self.kind

    @property
    def simplicity(self) -> tuple[int, int]:
        """Sort key, simplest first: linear, interleaved by chunk count, then the V."""
        return (_KINDS.index(self.kind), self.chunks)

    def stage_ranks(self, num_ranks: int) -> tuple[int, ...]:
        """Stage -> rank for ``num_ranks`` ranks (index: stage)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        stages = range(self.stages_per_rank * num_ranks)
        if self.kind == "v":
            return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in stages)
        return tuple(s % num_ranks for s in stages)


class ScheduleGenerator(Protocol):
    """A schedule: each rank's actions for p ranks and m micro-batches, as a validated Plan (p2p added).

    ``layer_names`` (one list per stage) name the stages' layers; a generator
    raises ValueError, saying what to change, where it does not apply.
    """

    def __call__(
        self, num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
    ) -> plan_pb2.Plan: ...


@dataclass(kw_only=True, frozen=True)
class ScheduleEntry:
    """One schedule: its unique ``name``, its ``placement``, its ``generator`` (None: torch interop only),
    whether it splits the backward into I and W, and torch's class with the same order, if any."""

    name: str
    placement: Placement
    generator: ScheduleGenerator | None
    split_backward: bool
    torch_class: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or " " in self.name:
            raise ValueError(f"a schedule name is one word without spaces (e.g. 'zb-h1'), got {self.name!r}")
        if self.name in RESERVED_NAMES:
            raise ValueError(
                f"schedule name {self.name!r} is reserved (the tuner and the closed loop use "
                f"{', '.join(sorted(RESERVED_NAMES))}): choose another"
            )
        if self.generator is None and self.torch_class is None:
            raise ValueError(f"schedule {self.name!r} has neither a generator nor a torch class: give one")

    @property
    def tunable(self) -> bool:
        """Whether octopipe can generate it (and so the tuner, the closed loop and the CLI offer it)."""
        return self.generator is not None

    def generate(
        self, num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
    ) -> plan_pb2.Plan:
        """The generator's plan, labelled ``schedule=<name>`` (and named ``<name>-p<p>-m<m>`` where the
        generator labels it otherwise, e.g. an existing generator registered under a new name)."""
        if self.generator is None:
            raise ValueError(
                f"schedule {self.name!r} has no octopipe generator (it is torch's {self.torch_class}, for the "
                "torch interop only): use octopipe.execute.runtime.interop.torch_schedule_plan"
            )
        plan = self.generator(num_ranks, num_microbatches, layer_names=layer_names)
        if plan.labels.get("schedule") != self.name:
            plan.name = f"{self.name}-p{num_ranks}-m{num_microbatches}"
            plan.labels["schedule"] = self.name
        return plan


@dataclass(frozen=True)
class ScheduleRegistry:
    """An immutable, ordered collection of :class:`ScheduleEntry` (names and torch classes unique).

    Order matters only within a placement family: the tuner tries a family's
    schedules in it (the first of equally fast ones wins).
    """

    entries: tuple[ScheduleEntry, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"schedules {twice} are registered more than once: names are unique")
        classes = [e.torch_class for e in self.entries if e.torch_class is not None]
        twice = sorted({c for c in classes if classes.count(c) > 1})
        if twice:
            raise ValueError(f"torch classes {twice} are given by more than one entry: one entry per torch class")

    def with_entry(self, entry: ScheduleEntry) -> ScheduleRegistry:
        """A new registry with ``entry`` appended (ValueError if its name or torch class is taken)."""
        return replace(self, entries=(*self.entries, entry))

    def __iter__(self) -> Iterator[ScheduleEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def tunable(self) -> tuple[ScheduleEntry, ...]:
        """The entries octopipe generates (what the tuner, the closed loop and the CLI offer)."""
        return tuple(e for e in self.entries if e.tunable)

    def entry(self, name: str) -> ScheduleEntry:
        """The entry called ``name``; ValueError listing the names otherwise."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(self.names)}")

    def require_baseline(self) -> None:
        """The tuners compare every plan with 1F1B on equal layer counts: ValueError unless ``"1f1b"`` is here."""
        if "1f1b" not in self or not self.entry("1f1b").tunable:
            raise ValueError(
                "the tuner's baseline is 1F1B on equal layer counts: the registry needs its '1f1b' entry "
                "(build it with DEFAULT_SCHEDULES.with_entry(...) rather than from scratch)"
            )

    @property
    def families(self) -> tuple[str, ...]:
        """The placement families of the tunable entries, simplest first (the order ``min_gain`` walks)."""
        placements = sorted({e.placement for e in self.tunable}, key=lambda p: p.simplicity)
        return tuple(p.label for p in placements)

    def placement(self, family: str) -> Placement:
        """The placement of family ``family`` (a :attr:`Placement.label`); ValueError listing the families."""
        for entry in self.tunable:
            if entry.placement.label == family:
                return entry.placement
        raise ValueError(f"unknown placement family {family!r}: use one of {', '.join(self.families)}")

    def in_family(self, family: str) -> tuple[ScheduleEntry, ...]:
        """The tunable entries on family ``family``, in registry order (ValueError for an unknown family)."""
        placement = self.placement(family)
        return tuple(e for e in self.tunable if e.placement == placement)

    @property
    def torch_classes(self) -> tuple[str, ...]:
        """torch.distributed.pipelining schedule classes with an entry, in registry order."""
        return tuple(e.torch_class for e in self.entries if e.torch_class is not None)

    def by_torch_class(self, torch_class: str) -> ScheduleEntry:
        """The entry of torch's schedule class ``torch_class``; ValueError listing the classes otherwise."""
        for entry in self.entries:
            if entry.torch_class == torch_class:
                return entry
        raise ValueError(f"unknown torch schedule {torch_class!r}: choose one of {', '.join(self.torch_classes)}")


def _interleaved(chunks: int) -> ScheduleGenerator:
    """Interleaved 1F1B with a fixed number of chunks per rank, as a (p, m) generator."""

    def generator(
        num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
    ) -> plan_pb2.Plan:
        return interleaved_1f1b(num_ranks, chunks, num_microbatches, layer_names=layer_names)

    generator.__name__ = generator.__qualname__ = f"interleaved_1f1b_{chunks}"
    generator.__doc__ = f"Interleaved 1F1B with {chunks} chunks per rank (``interleaved_1f1b(p, {chunks}, m)``)."
    return generator


_LINEAR, _V = Placement.linear(), Placement.v()

#: Every schedule octopipe knows. Add a schedule here: one entry.
DEFAULT_SCHEDULES = ScheduleRegistry(
    (
        ScheduleEntry(
            name="gpipe", placement=_LINEAR, generator=gpipe, split_backward=False, torch_class="ScheduleGPipe"
        ),
        ScheduleEntry(
            name="1f1b", placement=_LINEAR, generator=one_f_one_b, split_backward=False, torch_class="Schedule1F1B"
        ),
        # the same order as torch's ScheduleInterleavedZeroBubble on one stage per rank (that class is the
        # two-stages-per-rank entry below)
        ScheduleEntry(name="zb-h1", placement=_LINEAR, generator=zb_h1, split_backward=True),
        ScheduleEntry(name="zb-h2", placement=_LINEAR, generator=zb_h2, split_backward=True),
        ScheduleEntry(
            name="interleaved-1f1b",
            placement=Placement.interleaved(2),
            generator=_interleaved(2),
            split_backward=False,
            torch_class="ScheduleInterleaved1F1B",
        ),
        ScheduleEntry(
            name="interleaved-1f1b-4",
            placement=Placement.interleaved(4),
            generator=_interleaved(4),
            split_backward=False,
        ),
        ScheduleEntry(
            name="zb-v", placement=_V, generator=zb_v, split_backward=True, torch_class="ScheduleZBVZeroBubble"
        ),
        ScheduleEntry(name="v-half", placement=_V, generator=v_half, split_backward=True),
        ScheduleEntry(name="v-min", placement=_V, generator=v_min, split_backward=True),
        ScheduleEntry(
            name="dualpipe-v", placement=_V, generator=dualpipe_v, split_backward=True, torch_class="ScheduleDualPipeV"
        ),
        # torch interop only (no octopipe generator): imported from torch's own order
        ScheduleEntry(
            name="looped-bfs",
            placement=Placement.interleaved(2),
            generator=None,
            split_backward=False,
            torch_class="ScheduleLoopedBFS",
        ),
        ScheduleEntry(
            name="interleaved-zb",
            placement=Placement.interleaved(2),
            generator=None,
            split_backward=True,
            torch_class="ScheduleInterleavedZeroBubble",
        ),
    )
)
