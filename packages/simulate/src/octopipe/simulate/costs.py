"""The cost model: what each action of a plan costs in time and memory.

A :class:`CostModel` holds one :class:`StageCost` per stage (the sums of the
stage's layers' ``LayerCost``), the links between ranks, the OVERLAP_F_B model
and two tables that feed measurements back in: ``durations_us`` overrides a
stage's F / I / W / B time by ``(stage, kind)`` (for example the medians of
measured timelines, see :func:`durations_from_timelines`), and ``fused_us``
holds measured OVERLAP_F_B times by ``(forward stage, backward stage)``.
Build one from a Profile with :meth:`CostModel.from_profile`, or directly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from octopipe.ir.actions import ActionKind
from octopipe.ir.recompute import recompute_of
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.collectives import GroupLinks
from octopipe.simulate.links import Link
from octopipe.simulate.runtime_costs import RuntimeCosts
from octopipe.simulate.tensor_parallel import ParallelTraffic, split_layers

__all__ = [
    "RECOMPUTED_FIELDS",
    "CostModel",
    "Link",
    "OverlapModel",
    "StageCost",
    "TiedExchange",
    "durations_from_timelines",
    "recomputed_cost",
    "stage_cost_from_layers",
    "tied_exchanges",
]

_TIMED_KINDS = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
    ActionKind.FULL_BACKWARD,
    ActionKind.UNSHARD,
    ActionKind.REDUCE_GRAD,
)


@dataclass(kw_only=True, frozen=True, slots=True)
class StageCost:
    """What one stage costs for one micro-batch: the sums over its layers.

    F saves ``activation_bytes``; I frees ``freed_by_backward_input_bytes`` of
    them and W the rest; a full backward B frees all of them. I also allocates
    ``kept_for_weight_bytes`` (output gradients W needs), which W frees.
    ``output_bytes`` is the boundary tensor sent to the next stage (the
    gradient sent back to this stage has the same size).
    ``unsharded_bytes`` is what UNSHARD holds until RESHARD (None: the
    parameter bytes). ``all_to_all_bytes``: what each rank of an
    expert-parallel group sends in the stage's MoE all-to-alls in one F (and
    again in one I or B); timed only in plans whose mesh has ep > 1.
    ``expert_parameter_bytes``: the part of ``parameter_bytes`` in MoE experts,
    which a mesh with ep > 1 splits over the expert-parallel group.
    ``*_scratch_bytes``: what an action of the kind allocates and frees again
    before it ends (intermediates), held for the action's duration; the most
    of the stage's layers (they run one after another).
    ``parallel``: with tensor or context parallelism (mesh tp or cp > 1), the
    stage's collectives per micro-batch (``octopipe.simulate.tensor_parallel``);
    every other field is then one (tensor rank, context rank)'s share. None:
    no TP/CP traffic (the fields are what the rank does).
    """

    forward_us: float = 0.0
    backward_input_us: float = 0.0
    backward_weight_us: float = 0.0
    full_backward_us: float | None = None
    activation_bytes: int = 0
    freed_by_backward_input_bytes: int = 0
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
    output_bytes: int = 0
    unsharded_bytes: int | None = None
    unshard_us: float = 0.0
    reduce_grad_us: float = 0.0
    all_to_all_bytes: int = 0
    expert_parameter_bytes: int = 0
    kept_for_weight_bytes: int = 0
    forward_scratch_bytes: int = 0
    backward_input_scratch_bytes: int = 0
    backward_weight_scratch_bytes: int = 0
    full_backward_scratch_bytes: int = 0
    parallel: ParallelTraffic | None = None

    def __post_init__(self) -> None:
        for name in ("forward_us", "backward_input_us", "backward_weight_us", "unshard_us", "reduce_grad_us"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"StageCost.{name} must be a finite time >= 0, got {value}")
        if self.full_backward_us is not None and not 0 <= self.full_backward_us < math.inf:
            raise ValueError(f"StageCost.full_backward_us must be a finite time >= 0, got {self.full_backward_us}")
        if not 0 <= self.freed_by_backward_input_bytes <= self.activation_bytes:
            raise ValueError(
                f"StageCost.freed_by_backward_input_bytes ({self.freed_by_backward_input_bytes}) must be between 0 "
                f"and activation_bytes ({self.activation_bytes}): I frees part of what F saved"
            )
        for name in (
            "activation_bytes",
            "parameter_bytes",
            "gradient_bytes",
            "optimizer_state_bytes",
            "output_bytes",
            "all_to_all_bytes",
            "expert_parameter_bytes",
            "kept_for_weight_bytes",
            "forward_scratch_bytes",
            "backward_input_scratch_bytes",
            "backward_weight_scratch_bytes",
            "full_backward_scratch_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"StageCost.{name} must be >= 0, got {getattr(self, name)}")
        if self.expert_parameter_bytes > self.parameter_bytes:
            raise ValueError(
                f"StageCost.expert_parameter_bytes ({self.expert_parameter_bytes}) must be at most parameter_bytes "
                f"({self.parameter_bytes}): the experts are part of the stage's parameters"
            )

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: held for the whole step."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    def duration_us(self, kind: ActionKind) -> float:
        """The time of one action of ``kind`` on this stage (0 for untimed kinds)."""
        if kind is ActionKind.FORWARD:
            return self.forward_us
        if kind is ActionKind.BACKWARD_INPUT:
            return self.backward_input_us
        if kind is ActionKind.BACKWARD_WEIGHT:
            return self.backward_weight_us
        if kind is ActionKind.FULL_BACKWARD:
            if self.full_backward_us is None:
                return self.backward_input_us + self.backward_weight_us
            return self.full_backward_us
        if kind is ActionKind.UNSHARD:
            return self.unshard_us
        if kind is ActionKind.REDUCE_GRAD:
            return self.reduce_grad_us
        return 0.0


@dataclass(kw_only=True, frozen=True, slots=True)
class OverlapModel:
    """How long an OVERLAP_F_B unit of a forward f and a backward b takes.

    With ``use_measured`` a measured fused time (``CostModel.fused_us``, from the
    Profile's FusedCost) wins. Otherwise ``max(f, b) + (1 - hidden_fraction) *
    min(f, b)``: ``hidden_fraction=1`` is the lower bound max(f, b) (perfect
    overlap, the default), ``0`` the upper bound f + b (no overlap).
    """

    use_measured: bool = True
    hidden_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hidden_fraction <= 1.0:
            raise ValueError(f"OverlapModel.hidden_fraction must be in [0, 1], got {self.hidden_fraction}")

    def duration_us(self, forward_us: float, backward_us: float, measured_us: float | None = None) -> float:
        """The unit's duration."""
        if self.use_measured and measured_us is not None:
            return measured_us
        longer, shorter = max(forward_us, backward_us), min(forward_us, backward_us)
        if self.hidden_fraction == 1.0:
            return longer
        return longer + (1.0 - self.hidden_fraction) * shorter


@dataclass(kw_only=True, frozen=True)
class TiedExchange:
    """A parameter several stages hold (tied embeddings): each keeps a copy, keeps its gradient per
    micro-batch (not a running sum), and after the last action of the step every rank joins one
    broadcast of ``num_microbatches x size_bytes`` per holding stage, later stages first; each rank
    then adds them up in eager autograd's order (``octopipe.execute.runtime.whole_model.reduce_tied``)."""

    name: str
    size_bytes: int
    #: the holding stages, ascending (at least two)
    stages: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.size_bytes < 0 or len(self.stages) < 2 or list(self.stages) != sorted(set(self.stages)):
            raise ValueError(
                f"TiedExchange {self.name!r}: needs size_bytes >= 0 and two or more distinct stages in "
                f"ascending order, got {self.size_bytes} and {self.stages}"
            )


def tied_exchanges(
    tied: Iterable[profile_pb2.TiedParameter], stage_layers: Sequence[Sequence[str]]
) -> tuple[TiedExchange, ...]:
    """The profile's tied parameters as exchanges between the stages (each a list of layer names) that
    hold them; a parameter all of whose layers fall in one stage is an ordinary parameter there."""
    stage_of = {name: s for s, names in enumerate(stage_layers) for name in names}
    out = []
    for parameter in tied:
        stages = sorted({stage_of[name] for name in parameter.layer_names if name in stage_of})
        if len(stages) > 1:
            out.append(TiedExchange(name=parameter.name, size_bytes=parameter.size_bytes, stages=tuple(stages)))
    return tuple(out)


@dataclass(kw_only=True, frozen=True)
class CostModel:
    """Per-stage costs, links and overlap model: everything the simulator times.

    ``links`` maps (source rank, destination rank) to a :class:`Link`; pairs
    that are missing use ``default_link``, and a plan that needs a missing pair
    with no default is rejected. ``durations_us`` maps ``(stage, kind)`` to a
    measured duration that replaces the stage cost's (kinds F, I, W, B, UNSHARD,
    REDUCE_GRAD). ``fused_us`` maps ``(forward stage, backward stage)`` to a
    measured OVERLAP_F_B duration.

    ``collectives`` (:class:`~octopipe.simulate.collectives.GroupLinks`) times
    the collectives of plans with a mesh: with it, and dp > 1, UNSHARD is a
    ring all-gather of the stage's unsharded bytes and REDUCE_GRAD a ring
    reduce-scatter (all-reduce for a stage without UNSHARD) of its gradient
    bytes over the data-parallel group, once per bucket of ``bucket_bytes``
    per rank (None: one collective per stage, the runtime's default
    ``BucketPolicy``); with ep > 1 the stage's all-to-alls are added to F, I
    and B; with tp or cp > 1 (stages with ``StageCost.parallel``) the stages'
    tensor- and context-parallel collectives are added to F, I and B and the
    per-step gradient all-reduce over cp to REDUCE_GRAD (see
    ``octopipe.simulate.tensor_parallel``). Measured ``durations_us`` still win. Without it
    (or without a mesh) the StageCost's ``unshard_us`` / ``reduce_grad_us``
    apply, as before.

    ``tied``: parameters several stages hold (see :class:`TiedExchange`),
    which add the step's closing exchange and its buffers.

    ``runtime``: the runtime's own costs (:class:`~octopipe.simulate.runtime_costs.RuntimeCosts`:
    dispatch per action kind, CPU work per message on each end, the channel threads' share of the
    rank's core); every consumer reads them through :meth:`action_us`, :meth:`message_us` and
    :meth:`posting_us`. The default (all 0) times plans without them.
    """

    stages: tuple[StageCost, ...]
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    default_link: Link | None = None
    overlap: OverlapModel = field(default_factory=OverlapModel)
    durations_us: Mapping[tuple[int, ActionKind], float] = field(default_factory=dict)
    fused_us: Mapping[tuple[int, int], float] = field(default_factory=dict)
    microbatch_size: int = 1
    collectives: GroupLinks | None = None
    bucket_bytes: int | None = None
    tied: tuple[TiedExchange, ...] = ()
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("CostModel.stages is empty: give one StageCost per stage of the plan")
        for exchange in self.tied:
            if exchange.stages[-1] >= len(self.stages):
                raise ValueError(f"TiedExchange {exchange.name!r}: stage {exchange.stages[-1]} is not in the model")
        if self.microbatch_size < 1:
            raise ValueError(f"CostModel.microbatch_size must be >= 1, got {self.microbatch_size}")
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise ValueError(
                f"CostModel.bucket_bytes must be >= 1 (or None: one bucket per stage), got {self.bucket_bytes}"
            )
        for (stage, kind), value in self.durations_us.items():
            if kind not in _TIMED_KINDS:
                raise ValueError(
                    f"durations_us[({stage}, {kind})]: only F, I, W, B, UNSHARD and REDUCE_GRAD have "
                    "durations of their own (communication is timed by links, OVERLAP_F_B by fused_us)"
                )
            if not 0 <= value < math.inf:
                raise ValueError(f"durations_us[({stage}, {kind.name})] must be a finite time >= 0, got {value}")

    @classmethod
    def uniform(
        cls, *, num_stages: int, stage: StageCost, link: Link | None = None, microbatch_size: int = 1
    ) -> CostModel:
        """Every stage costs ``stage``; every pair of ranks is joined by ``link`` (default: free)."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        return cls(stages=(stage,) * num_stages, default_link=link or Link(), microbatch_size=microbatch_size)

    @classmethod
    def from_profile(
        cls,
        plan: plan_pb2.Plan,
        profile: profile_pb2.Profile,
        *,
        default_link: Link | None = None,
        overlap: OverlapModel | None = None,
        durations_us: Mapping[tuple[int, ActionKind], float] | None = None,
        collective_bandwidth_bytes_per_second: float | None = None,
    ) -> CostModel:
        """Sum each stage's layers' LayerCost; take links and fused times from the Profile.

        ``collective_bandwidth_bytes_per_second`` times UNSHARD (parameter bytes)
        and REDUCE_GRAD (gradient bytes); without it collectives take no time.
        A plan whose mesh has tp or cp > 1 gets each stage as one (tensor rank,
        context rank) runs it, with its TP/CP traffic (``stage_cost_from_layers``).
        The Profile's ``collectives`` (per group kind) become ``collectives``,
        which time them by group size in plans with a mesh; its ``runtime``
        becomes ``runtime`` (absent: no runtime costs).
        """
        layers = {layer.layer_name: layer for layer in profile.layers}
        stage_layers = [tuple(stage.layer_names) for stage in plan.stages]
        # tensor / context parallelism: each stage's costs are one (tensor rank, context rank)'s share
        tp, cp = (plan.mesh.tp or 1, plan.mesh.cp or 1) if plan.HasField("mesh") else (1, 1)
        sp = plan.HasField("mesh") and plan.mesh.sequence_parallel
        costs = [
            _stage_cost(
                index, names, layers, collective_bandwidth_bytes_per_second, tp, cp, sp,
                recompute=recompute_of(plan.stages[index]).label,
            )
            for index, names in enumerate(stage_layers)
        ]  # fmt: skip
        links = {}
        for message in profile.links:
            key = (message.source_rank, message.destination_rank)
            try:
                links[key] = Link.from_proto(message)
            except ValueError as exc:
                raise ValueError(f"profile link {key[0]}->{key[1]}: {exc}") from None
        by_names = {names: index for index, names in enumerate(stage_layers)}
        fused: dict[tuple[int, int], float] = {}
        for measured in profile.fused:
            forward = by_names.get(tuple(measured.forward_layer_names))
            backward = by_names.get(tuple(measured.backward_layer_names))
            if forward is not None and backward is not None:
                fused[(forward, backward)] = measured.duration_us
        return cls(
            stages=tuple(costs),
            links=links,
            default_link=default_link,
            overlap=overlap or OverlapModel(),
            durations_us=dict(durations_us or {}),
            fused_us=fused,
            microbatch_size=max(1, profile.microbatch_size),
            collectives=GroupLinks.from_profile(profile),
            tied=tied_exchanges(profile.tied_parameters, stage_layers),
            runtime=RuntimeCosts.from_proto(profile.runtime) if profile.HasField("runtime") else RuntimeCosts(),
        )

    def link(self, source: int, destination: int) -> Link:
        """The link from ``source`` to ``destination``."""
        found = self.links.get((source, destination), self.default_link)
        if found is None:
            raise ValueError(
                f"no link cost from rank {source} to rank {destination}: add a LinkCost to the profile "
                "or pass default_link=Link(...) to the cost model"
            )
        return found

    def duration_us(self, stage: int, kind: ActionKind) -> float:
        """The time of one ``kind`` action on ``stage``: a measured override, else the stage cost."""
        override = self.durations_us.get((stage, kind))
        if override is not None:
            return override
        return self.stages[stage].duration_us(kind)

    def action_us(self, stage: int, kind: ActionKind) -> float:
        """What one compute action of ``kind`` on ``stage`` costs the rank's program: its work
        (:meth:`duration_us`) plus the runtime's dispatch of it (``runtime.dispatch_us``)."""
        return self.duration_us(stage, kind) + self.runtime.dispatch(kind)

    def message_us(self, source: int, destination: int, num_bytes: int) -> float:
        """One message's time from posted to delivered: the link's latency and bandwidth (the probe's) plus
        both ends' CPU work for it (``runtime.send_cpu`` / ``recv_cpu``)."""
        return self.link(source, destination).transfer_us(num_bytes) + self.runtime.message_cpu_us(num_bytes)

    def posting_us(self, kind: ActionKind, num_bytes: int) -> float:
        """What posting one SEND or RECV costs the rank's program (``RuntimeCosts.posting_us``)."""
        return self.runtime.posting_us(kind, num_bytes)

    def boundary_us(self, source: int, destination: int, num_bytes: int) -> float:
        """A boundary tensor's delay as the tuners' dependency graphs see it (one edge from producer to
        consumer): the sender's posting, the message and the receiver's posting."""
        return (
            self.posting_us(ActionKind.SEND_F, num_bytes)
            + self.message_us(source, destination, num_bytes)
            + self.posting_us(ActionKind.RECV_F, num_bytes)
        )

    def overlap_us(self, forward_stage: int, backward_stage: int, backward_kind: ActionKind) -> float:
        """The time of an OVERLAP_F_B unit of F on ``forward_stage`` and I or B on ``backward_stage``."""
        return self.overlap.duration_us(
            self.duration_us(forward_stage, ActionKind.FORWARD),
            self.duration_us(backward_stage, backward_kind),
            self.fused_us.get((forward_stage, backward_stage)),
        )


def stage_scratch(costs: Sequence[profile_pb2.LayerCost], *, first: bool = False) -> dict[str, int]:
    """A stage's scratch per action kind from its layers' (``StageCost.*_scratch_bytes``).

    The layers run one after another inside an action (F first to last, I last
    to first), each making its saved (F) or kept-for-W (I) bytes: F's and I's
    scratch is the most a layer needs above what the stage has made by then,
    counted above all of them (the simulator allocates them at the start). A stage's W (and full backward) graph returns every
    layer's parameter gradients at once (the runtime adds them into the
    accumulated gradients afterwards), made from the last layer to the first:
    its scratch is the most, over layers, of the later layers' gradients plus
    the layer's own scratch (which includes its gradients). (The first W or B of a stage in a
    step makes the gradients that are accumulated, which the static bytes
    count: the simulator leaves them out of that action's scratch.) The first
    stage's I computes nothing (``first``), so its W's scratch is the full
    backward's.
    """
    if not costs:
        return {}

    def with_gradients(field: str) -> int:
        # backward runs from the last layer to the first: when layer j runs, the later layers' gradients exist
        later, most = 0, 0
        for cost in reversed(costs):
            most = max(most, later + int(getattr(cost, field)))
            later += cost.gradient_bytes
        return most

    def above_running(field: str, kept: str, order: Iterable[profile_pb2.LayerCost]) -> int:
        # the simulator allocates the stage's kept bytes (F: saved, I: kept for W) when the action starts; the
        # layers make theirs one after another, so a layer's scratch rides on those made so far, not on all
        held, most, total = 0, 0, sum(int(getattr(c, kept)) for c in costs)
        for cost in order:
            held += int(getattr(cost, kept))
            most = max(most, held + int(getattr(cost, field)))
        return max(0, most - total)

    weight_field = (
        "full_backward_scratch_bytes"
        if first and any(c.full_backward_scratch_bytes for c in costs)
        else "backward_weight_scratch_bytes"
    )
    return {
        "forward_scratch_bytes": above_running("forward_scratch_bytes", "activation_saved_bytes", costs),
        "backward_input_scratch_bytes": 0
        if first
        else above_running("backward_input_scratch_bytes", "backward_input_kept_bytes", reversed(costs)),
        # the first stage's W back-propagates through the whole stage (its I computes nothing): the full
        # backward's scratch, the input gradients between its layers included
        "backward_weight_scratch_bytes": with_gradients(weight_field)
        if any(getattr(c, weight_field) for c in costs)
        else 0,
        "full_backward_scratch_bytes": with_gradients("full_backward_scratch_bytes")
        if any(c.full_backward_scratch_bytes for c in costs)
        else 0,
    }


def _stage_cost(
    index: int,
    names: tuple[str, ...],
    layers: Mapping[str, profile_pb2.LayerCost],
    collective_bandwidth: float | None,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    *,
    recompute: str = "none",
) -> StageCost:
    if not names:
        raise ValueError(
            f"stage {index} has no layer names, so its cost cannot be looked up in the profile "
            "(plans imported from torch CSV have none): name the stage's layers in the plan, "
            "or build the CostModel from StageCost values (e.g. CostModel.uniform)"
        )
    missing = [name for name in names if name not in layers]
    if missing:
        raise ValueError(f"stage {index}: layers {missing} are not in the profile: profile them or fix the plan")
    try:
        return stage_cost_from_layers(
            [recomputed_cost(layers[name], recompute) for name in names],
            collective_bandwidth=collective_bandwidth,
            tp=tp,
            cp=cp,
            sequence_parallel=sequence_parallel,
        )
    except ValueError as exc:
        raise ValueError(f"stage {index} (layers {list(names)}): {exc}") from None


#: the LayerCost fields recomputation changes: a layer under a policy is its profiled cost with these taken
#: from the policy's ``recomputed`` entry (sizes of parameters, experts, boundaries and traffic stay)
RECOMPUTED_FIELDS = (
    "forward_duration_us",
    "backward_input_duration_us",
    "backward_weight_duration_us",
    "full_backward_duration_us",
    "activation_saved_bytes",
    "activation_freed_by_backward_input_bytes",
    "activation_freed_by_backward_weight_bytes",
    "forward_scratch_bytes",
    "backward_input_scratch_bytes",
    "backward_weight_scratch_bytes",
    "full_backward_scratch_bytes",
    "backward_input_kept_bytes",
)


def recomputed_cost(layer: profile_pb2.LayerCost, recompute: str) -> profile_pb2.LayerCost:
    """``layer`` as a stage with recomputation policy ``recompute`` (``none``, ``layers``, ``budget:F``) runs it.

    Refused, naming the policies profiled, when the profile has no entry for it: a plan that recomputes is
    never simulated as if it saved everything."""
    if recompute == "none":
        return layer
    variant = next((v for v in layer.recomputed if v.recompute == recompute), None)
    if variant is None:
        have = sorted(v.recompute for v in layer.recomputed) or ["none"]
        raise ValueError(
            f"layer {layer.layer_name!r} was not profiled with recompute policy {recompute!r} (profiled: "
            f"{', '.join(have)}): profile with that policy (ProfilerConfig.recompute, octopipe profile --recompute)"
        )
    out = profile_pb2.LayerCost()
    out.CopyFrom(layer)
    out.ClearField("recomputed")
    for name in RECOMPUTED_FIELDS:
        if name != "full_backward_duration_us":
            setattr(out, name, getattr(variant, name))
    if variant.HasField("full_backward_duration_us"):
        out.full_backward_duration_us = variant.full_backward_duration_us
    else:
        out.ClearField("full_backward_duration_us")
    out.recompute = recompute
    return out


def stage_cost_from_layers(
    costs: Sequence[profile_pb2.LayerCost],
    *,
    collective_bandwidth: float | None = None,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
) -> StageCost:
    """One stage's cost from its layers' LayerCost, in model order: the one place a stage is summed.

    ``CostModel.from_profile`` and the tuner (whose stages change as it
    searches) both call it, so a tuned plan means the same on both sides.
    ``collective_bandwidth`` (bytes/s) times UNSHARD and REDUCE_GRAD; None: free.
    ``tp`` / ``cp`` > 1: every layer's share on one (tensor rank, context rank)
    is summed instead, and ``parallel`` holds the stage's TP/CP traffic
    (``octopipe.simulate.tensor_parallel``); at tp = cp = 1 nothing changes.
    """
    if not costs:
        raise ValueError("a stage needs at least one layer")
    if tp < 1 or cp < 1:
        raise ValueError(f"tp and cp must be >= 1, got tp={tp}, cp={cp}")
    if tp * cp > 1:
        shares, traffic = split_layers(costs, tp, cp, sequence_parallel)
        whole = stage_cost_from_layers(shares, collective_bandwidth=collective_bandwidth)
        return replace(whole, parallel=traffic)
    saved = sum(c.activation_saved_bytes for c in costs)
    params = sum(c.parameter_bytes for c in costs)
    grads = sum(c.gradient_bytes for c in costs)
    bandwidth = collective_bandwidth
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"collective_bandwidth_bytes_per_second must be > 0, got {bandwidth}")
    # a stage whose input needs no gradient (the model's data) has no I to compute: its W back-propagates
    # through the stage itself (the runtime's split graphs do exactly this)
    first = costs[0].input_without_gradient
    scratch = stage_scratch(costs, first=first)
    return StageCost(
        forward_us=sum(c.forward_duration_us for c in costs),
        backward_input_us=0.0 if first else sum(c.backward_input_duration_us for c in costs),
        backward_weight_us=sum(
            c.backward_weight_duration_us + (c.backward_input_duration_us if first else 0.0) for c in costs
        ),
        full_backward_us=sum(
            c.full_backward_duration_us
            if c.HasField("full_backward_duration_us")
            else c.backward_input_duration_us + c.backward_weight_duration_us
            for c in costs
        ),
        activation_bytes=saved,
        freed_by_backward_input_bytes=0 if first else sum(c.activation_freed_by_backward_input_bytes for c in costs),
        parameter_bytes=params,
        gradient_bytes=grads,
        optimizer_state_bytes=sum(c.optimizer_state_bytes for c in costs),
        output_bytes=sum(t.size_bytes for t in costs[-1].output_tensors),
        unshard_us=0.0 if bandwidth is None else params / bandwidth * 1e6,
        reduce_grad_us=0.0 if bandwidth is None else grads / bandwidth * 1e6,
        all_to_all_bytes=sum(c.all_to_all_bytes for c in costs),
        expert_parameter_bytes=sum(c.expert_parameter_bytes for c in costs),
        kept_for_weight_bytes=0 if first else sum(c.backward_input_kept_bytes for c in costs),
        forward_scratch_bytes=scratch["forward_scratch_bytes"],
        backward_input_scratch_bytes=scratch["backward_input_scratch_bytes"],
        backward_weight_scratch_bytes=scratch["backward_weight_scratch_bytes"],
        full_backward_scratch_bytes=scratch["full_backward_scratch_bytes"],
    )


def durations_from_timelines(
    timelines: Iterable[profile_pb2.RankTimeline],
) -> dict[tuple[int, ActionKind], float]:
    """Median measured duration per ``(stage, kind)`` for F, I, W, B, UNSHARD and REDUCE_GRAD.

    Feed the result to ``CostModel.from_profile(..., durations_us=...)`` (or
    ``dataclasses.replace(model, durations_us=...)``) to simulate with measured
    times instead of profiled layer sums.
    """
    samples: dict[tuple[int, ActionKind], list[float]] = {}
    timed = {kind.proto for kind in _TIMED_KINDS}
    for timeline in timelines:
        for record in timeline.records:
            if record.action.kind in timed:
                key = (record.action.stage_index, ActionKind.from_proto(record.action.kind))
                samples.setdefault(key, []).append(record.end_us - record.start_us)
    return {key: statistics.median(values) for key, values in samples.items()}
