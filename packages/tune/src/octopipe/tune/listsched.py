"""A greedy list scheduler: a schedule for any partition and placement, from costs.

It plays the step out on nominal costs (each rank's compute stream runs one
action at a time; a transfer between ranks takes the link's time) and, each time
a rank is free, picks what to run next:

* the forwards and input backwards (I, or B without the split) that are ready,
  in the order of the policy: ``"backward"`` runs a ready backward before a
  ready forward (1F1B-like: the backward chain is the critical path once the
  pipeline is full), ``"forward"`` the other way round (ZB-H2-like: fill the
  warm-up bubble first);
* when none is ready, a pending weight gradient W fills the gap;
* a micro-batch enters a rank only if the rank's memory cap holds the
  activations of all its stages for it (reserved at entry, so a micro-batch in
  flight never waits for memory and the schedule cannot deadlock) and the
  rank's in-flight limit allows; when memory is short, pending W's run first,
  since they free it.

Forwards and backwards of a stage go in micro-batch order. The result is a
compute-only order per rank; the simulator then times it exactly (its channel
and memory model is finer than this one's).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from octopipe.ir import Action, ActionKind
from octopipe.simulate import CostModel

__all__ = ["ListSchedulerConfig", "list_schedule"]

_F, _I, _W, _B = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD
_UNKNOWN = float("inf")


@dataclass(kw_only=True, frozen=True)
class ListSchedulerConfig:
    """How the list scheduler decides.

    ``priority``: ``"backward"`` (a ready backward first) or ``"forward"``.
    ``split_backward``: I + W (W fills gaps) or one B per micro-batch.
    ``max_in_flight``: per rank, the most micro-batches between entering the
    rank (its first stage's F) and leaving it (its first stage's W, or B);
    None: only memory limits it. ``max_ahead``: per rank, the most
    micro-batches that entered and have not had their first stage's I (or B)
    yet; None: no limit beyond ``max_in_flight``.
    ``reserve_memory``: a micro-batch entering a rank reserves the
    activations of all the rank's stages (safe: it never waits for memory
    later); otherwise later stages' forwards take memory when they run and
    may wait for it (tighter packing; the oldest micro-batch always goes on).
    ``memory_margin_bytes``: per rank, bytes kept free under the cap for what
    this model does not count (p2p buffers).
    """

    priority: Literal["backward", "forward"] = "backward"
    split_backward: bool = True
    max_in_flight: Sequence[int] | None = None
    max_ahead: Sequence[int] | None = None
    reserve_memory: bool = True
    memory_margin_bytes: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.priority not in ("backward", "forward"):
            raise ValueError(f"priority must be 'backward' or 'forward', got {self.priority!r}")
        for name in ("max_in_flight", "max_ahead"):
            limits = getattr(self, name)
            if limits is not None and any(k < 1 for k in limits):
                raise ValueError(f"{name} must be >= 1 per rank, got {list(limits)}")


def list_schedule(
    costs: CostModel,
    placement: Sequence[int],
    num_microbatches: int,
    *,
    memory_caps: Mapping[int, int] | None = None,
    config: ListSchedulerConfig | None = None,
) -> dict[int, list[Action]]:
    """Each rank's compute actions, built greedily from ``costs`` (see the module doc).

    ``placement[s]`` is the rank of stage s; ``memory_caps`` maps ranks to
    bytes (static bytes of the rank's stages included, as in the simulator).
    Raises ValueError when a cap cannot hold one micro-batch's activations.
    """
    config = config or ListSchedulerConfig()
    return _Scheduler(costs, placement, num_microbatches, dict(memory_caps or {}), config).run()


class _Scheduler:
    def __init__(
        self,
        costs: CostModel,
        placement: Sequence[int],
        m: int,
        caps: dict[int, int],
        config: ListSchedulerConfig,
    ) -> None:
        if m < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {m}")
        if len(costs.stages) != len(placement):
            raise ValueError(
                f"the cost model has {len(costs.stages)} stages but the placement {len(placement)}: one rank per stage"
            )
        self.m, self.config, self.placement = m, config, list(placement)
        self.num_stages = len(placement)
        self.num_ranks = max(placement) + 1
        self.stages_of: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, r in enumerate(placement):
            self.stages_of[r].append(s)
        if any(not stages for stages in self.stages_of):
            empty = [r for r, stages in enumerate(self.stages_of) if not stages]
            raise ValueError(f"ranks {empty} have no stage: place at least one stage on every rank")
        split = config.split_backward
        self.back_kind = _I if split else _B
        # the runtime's costs too (CostModel.action_us / boundary_us): the terms the simulator reads
        self.dur = {(s, kind): costs.action_us(s, kind) for s in range(self.num_stages) for kind in (_F, _I, _W, _B)}
        self.send_f = [
            costs.boundary_us(placement[s], placement[s + 1], costs.stages[s].output_bytes)
            if s + 1 < self.num_stages and placement[s + 1] != placement[s]
            else 0.0
            for s in range(self.num_stages)
        ]
        self.send_b = [
            costs.boundary_us(placement[s], placement[s - 1], costs.stages[s - 1].output_bytes)
            if s > 0 and placement[s - 1] != placement[s]
            else 0.0
            for s in range(self.num_stages)
        ]
        self.act = act = [c.activation_bytes for c in costs.stages]
        self.reserving = config.reserve_memory
        self.freed_i = [c.freed_by_backward_input_bytes if split else c.activation_bytes for c in costs.stages]
        self.freed_w = [act[s] - self.freed_i[s] if split else 0 for s in range(self.num_stages)]
        self.entry = [min(stages) for stages in self.stages_of]
        self.reserve = [sum(act[s] for s in stages) for stages in self.stages_of]
        self.static = [0] * self.num_ranks
        for s, r in enumerate(placement):
            self.static[r] += costs.stages[s].static_bytes
        margins = list(config.memory_margin_bytes or [0] * self.num_ranks)
        self.budget: list[float] = []
        for r in range(self.num_ranks):
            if r not in caps:
                self.budget.append(_UNKNOWN)
                continue
            budget = caps[r] - self.static[r] - margins[r]
            if budget < self.reserve[r]:
                raise ValueError(
                    f"rank {r}'s memory cap of {caps[r]} bytes cannot hold its static bytes ({self.static[r]}) "
                    f"and one micro-batch's activations ({self.reserve[r]}): raise the cap or move layers off rank {r}"
                )
            self.budget.append(budget)
        self.limit = self.per_rank("max_in_flight", config.max_in_flight)
        self.ahead_limit = self.per_rank("max_ahead", config.max_ahead)
        # Progress.
        self.next_f = [0] * self.num_stages
        self.next_b = [0] * self.num_stages
        self.f_end: list[list[float]] = [[_UNKNOWN] * m for _ in range(self.num_stages)]
        self.b_end: list[list[float]] = [[_UNKNOWN] * m for _ in range(self.num_stages)]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(self.num_ranks)]
        self.used = [0] * self.num_ranks  # reserved activation bytes
        self.in_flight = [0] * self.num_ranks
        self.ahead = [0] * self.num_ranks
        self.left = [0] * self.num_ranks  # micro-batches that left each rank (they leave in order)
        self.free_at = [0.0] * self.num_ranks
        self.programs: dict[int, list[Action]] = {r: [] for r in range(self.num_ranks)}
        self.remaining = [len(stages) * m * (3 if split else 2) for stages in self.stages_of]

    def per_rank(self, name: str, limits: Sequence[int] | None) -> list[int]:
        if limits is None:
            return [self.m] * self.num_ranks
        if len(limits) != self.num_ranks:
            raise ValueError(f"{name} has {len(limits)} entries; give one per rank ({self.num_ranks})")
        return list(limits)

    # -- readiness -------------------------------------------------------------------------------------------
    def forward_ready(self, s: int) -> float:
        mb = self.next_f[s]
        if mb >= self.m:
            return _UNKNOWN
        r = self.placement[s]
        if s == self.entry[r]:
            if (
                self.in_flight[r] >= self.limit[r]
                or self.ahead[r] >= self.ahead_limit[r]
                or self.used[r] + self.reserve[r] > self.budget[r]
            ):
                return _UNKNOWN
        elif not self.reserving and mb > self.left[r] and self.used[r] + self.act[s] > self.budget[r]:
            return _UNKNOWN
        if s == 0:
            return 0.0
        return self.f_end[s - 1][mb] + self.send_f[s - 1]

    def backward_ready(self, s: int) -> float:
        mb = self.next_b[s]
        if mb >= self.m or self.f_end[s][mb] == _UNKNOWN:
            return _UNKNOWN
        if s == self.num_stages - 1:
            return self.f_end[s][mb]
        return max(self.f_end[s][mb], self.b_end[s + 1][mb] + self.send_b[s + 1])

    def choose(self, r: int) -> tuple[float, ActionKind, int] | None:
        """The rank's next (start time, kind, stage), or None if it must wait for another rank."""
        now = self.free_at[r]
        best: tuple[tuple[int, int, int], float, ActionKind, int] | None = None
        earliest = _UNKNOWN
        backward_first = self.config.priority == "backward"
        for s in self.stages_of[r]:
            ready = self.forward_ready(s)
            if ready <= now:
                key = (1 if backward_first else 0, self.next_f[s], -s)
                if best is None or key < best[0]:
                    best = (key, now, _F, s)
            earliest = min(earliest, ready)
            ready = self.backward_ready(s)
            if ready <= now:
                key = (0 if backward_first else 1, self.next_b[s], s)
                if best is None or key < best[0]:
                    best = (key, now, self.back_kind, s)
            earliest = min(earliest, ready)
        if best is not None:
            return best[1], best[2], best[3]
        if self.pending_w[r]:
            return now, _W, self.pending_w[r][0][0]
        if earliest < _UNKNOWN:
            return self.choose_at(r, earliest)
        return None

    def choose_at(self, r: int, time: float) -> tuple[float, ActionKind, int] | None:
        saved = self.free_at[r]
        self.free_at[r] = time
        try:
            return self.choose(r)
        finally:
            self.free_at[r] = saved

    # -- running -----------------------------------------------------------------------------------------------
    def execute(self, r: int, start: float, kind: ActionKind, s: int) -> list[int]:
        """Run one action; return the ranks whose options it changed."""
        end = start + self.dur[s, kind]
        self.free_at[r] = end
        self.remaining[r] -= 1
        touched = [r]
        if kind is _F:
            mb = self.next_f[s]
            self.next_f[s] += 1
            self.f_end[s][mb] = end
            if s == self.entry[r]:
                self.in_flight[r] += 1
                self.ahead[r] += 1
                if self.reserving:
                    self.used[r] += self.reserve[r]
            if not self.reserving:
                self.used[r] += self.act[s]
            if s + 1 < self.num_stages:
                touched.append(self.placement[s + 1])
        elif kind is _W:
            s, mb = self.pending_w[r].popleft()
            self.used[r] -= self.freed_w[s]
            if s == self.entry[r]:  # its last backward work on this rank: the micro-batch leaves
                self.in_flight[r] -= 1
                self.left[r] += 1
        else:
            mb = self.next_b[s]
            self.next_b[s] += 1
            self.b_end[s][mb] = end
            self.used[r] -= self.freed_i[s]
            if s == self.entry[r]:
                self.ahead[r] -= 1
            if kind is _I:
                self.pending_w[r].append((s, mb))
            elif s == self.entry[r]:  # its last backward on this rank: the micro-batch leaves
                self.in_flight[r] -= 1
                self.left[r] += 1
            if s > 0:
                touched.append(self.placement[s - 1])
        self.programs[r].append(Action(kind, s, mb))
        return touched

    def run(self) -> dict[int, list[Action]]:
        heap: list[tuple[float, int, int]] = []
        version = [0] * self.num_ranks

        def push(r: int) -> None:
            version[r] += 1
            if self.remaining[r] == 0:
                return
            choice = self.choose(r)
            if choice is not None:
                heapq.heappush(heap, (choice[0], r, version[r]))

        for r in range(self.num_ranks):
            push(r)
        while heap:
            _, r, seen = heapq.heappop(heap)
            if seen != version[r]:
                continue
            choice = self.choose(r)
            assert choice is not None  # its options only grow while it waits
            start, kind, s = choice
            for other in dict.fromkeys(self.execute(r, start, kind, s)):
                push(other)
        stuck = [r for r in range(self.num_ranks) if self.remaining[r]]
        if stuck:
            raise ValueError(
                f"the list scheduler could not place every action (ranks {stuck} stuck): the memory caps are too "
                "tight for this placement; raise them or use fewer stages per rank"
            )
        return self.programs
