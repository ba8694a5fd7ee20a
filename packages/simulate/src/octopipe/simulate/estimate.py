"""What a simulation predicts, as Python objects and as an ``octopipe.estimate.v1.Estimate``.

Bubble ratio convention: idle compute time / step time. Per rank,
``idle_us = step_time_us - busy_us`` and ``bubble_ratio = idle_us /
step_time_us``; for the plan, the sum of idle time over ranks divided by
(ranks x step time), i.e. the mean idle fraction of the compute streams.
(The other common convention, bubble / (m x (F + B)), is ``idle_us /
busy_us`` per rank.)
"""

from __future__ import annotations

from dataclasses import dataclass

from octopipe.estimate.v1 import estimate_pb2
from octopipe.ir.actions import action_to_proto, parse_action
from octopipe.ir.program import COMPUTE, OVERLAP, STAGE_WIDE, Label, Program, stream_of
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate.engine import Timing

__all__ = [
    "Estimate",
    "PathStep",
    "RankEstimate",
    "communication_overlap",
    "critical_path",
    "label_proto",
    "stream_of",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class RankEstimate:
    """One rank: compute busy/idle time, memory, communication (see the module doc for the ratio)."""

    rank: int
    busy_us: float
    idle_us: float
    bubble_ratio: float
    static_memory_bytes: int
    peak_activation_bytes: int
    peak_memory_bytes: int
    peak_memory_time_us: float
    memory_cap_bytes: int | None
    communication_us: float
    hidden_communication_us: float

    @property
    def fits(self) -> bool:
        """Whether the rank's peak memory is within its cap (True without a cap)."""
        return self.memory_cap_bytes is None or self.peak_memory_bytes <= self.memory_cap_bytes


@dataclass(kw_only=True, frozen=True, slots=True)
class PathStep:
    """One action on the critical path; a transfer appears as its SEND."""

    rank: int
    step: int
    action: str
    stream: str
    start_us: float
    end_us: float


@dataclass(kw_only=True, frozen=True, slots=True)
class Estimate:
    """The simulator's prediction for one step of a plan (times in microseconds)."""

    plan_name: str
    plan_version: int
    num_microbatches: int
    samples_per_step: int
    step_time_us: float
    samples_per_second: float
    tokens_per_second: float | None
    bubble_ratio: float
    communication_us: float
    hidden_communication_us: float
    ranks: tuple[RankEstimate, ...]
    critical_path: tuple[PathStep, ...]

    @property
    def communication_overlap_ratio(self) -> float:
        """Hidden communication / all communication (1.0 when there is none: nothing is exposed)."""
        if self.communication_us == 0.0:
            return 1.0
        return self.hidden_communication_us / self.communication_us

    @property
    def fits(self) -> bool:
        """Whether every rank stays within its memory cap."""
        return all(rank.fits for rank in self.ranks)

    def to_proto(self) -> estimate_pb2.Estimate:
        """The ``octopipe.estimate.v1.Estimate`` message (without timelines)."""
        message = estimate_pb2.Estimate(
            plan_name=self.plan_name,
            plan_version=self.plan_version,
            num_microbatches=self.num_microbatches,
            samples_per_step=self.samples_per_step,
            step_duration_us=self.step_time_us,
            samples_per_second=self.samples_per_second,
            bubble_ratio=self.bubble_ratio,
            communication_duration_us=self.communication_us,
            communication_hidden_duration_us=self.hidden_communication_us,
            communication_overlap_ratio=self.communication_overlap_ratio,
        )
        if self.tokens_per_second is not None:
            message.tokens_per_second = self.tokens_per_second
        for rank in self.ranks:
            entry = message.ranks.add(
                rank=rank.rank,
                busy_duration_us=rank.busy_us,
                idle_duration_us=rank.idle_us,
                bubble_ratio=rank.bubble_ratio,
                static_memory_bytes=rank.static_memory_bytes,
                peak_activation_bytes=rank.peak_activation_bytes,
                peak_memory_bytes=rank.peak_memory_bytes,
                peak_memory_time_us=rank.peak_memory_time_us,
                communication_duration_us=rank.communication_us,
                communication_hidden_duration_us=rank.hidden_communication_us,
            )
            if rank.memory_cap_bytes is not None:
                entry.memory_cap_bytes = rank.memory_cap_bytes
        for step in self.critical_path:
            message.critical_path.add(
                rank=step.rank,
                step_index=step.step,
                action=action_to_proto(parse_action(step.action)),
                stream=step.stream,
                start_us=step.start_us,
                end_us=step.end_us,
            )
        return message


def label_proto(label: Label) -> plan_pb2.Action:
    """The ``octopipe.plan.v1.Action`` of a compiled label."""
    kind = label[0]
    if kind == OVERLAP:
        message = plan_pb2.Action(kind=plan_pb2.ACTION_KIND_OVERLAP_F_B)
        message.sub_actions.add(kind=plan_pb2.ACTION_KIND_FORWARD, stage_index=label[1], microbatch_index=label[2])
        message.sub_actions.add(
            kind=plan_pb2.ActionKind.ValueType(label[3]), stage_index=label[4], microbatch_index=label[5]
        )
        return message
    message = plan_pb2.Action(kind=plan_pb2.ActionKind.ValueType(kind), stage_index=label[1])
    if kind not in STAGE_WIDE:
        message.microbatch_index = label[2]
    return message


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge sorted intervals into disjoint ones."""
    merged: list[tuple[float, float]] = []
    for begin, end in intervals:
        if merged and begin <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def communication_overlap(program: Program, timing: Timing, rank: int) -> tuple[float, float]:
    """(communication time, the part of it under the rank's compute) for one rank.

    Communication is the union of the transfers the rank sends or receives and
    its collectives; compute is the union of its compute actions.
    """
    codes, starts, ends = program.codes[rank], timing.starts[rank], timing.ends[rank]
    comm = [
        (starts[step], ends[step]) for step, kind in enumerate(codes) if kind > OVERLAP and ends[step] > starts[step]
    ]
    if not comm:
        return 0.0, 0.0
    comm.sort()
    merged = _merge(comm)
    total = sum(end - begin for begin, end in merged)
    # Compute actions run one at a time in program order, so their intervals are sorted and disjoint.
    compute = [step for step, kind in enumerate(codes) if kind <= OVERLAP and ends[step] > starts[step]]
    hidden = 0.0
    index = 0
    for begin, end in merged:
        while index < len(compute) and ends[compute[index]] <= begin:
            index += 1
        probe = index
        while probe < len(compute) and starts[compute[probe]] < end:
            step = compute[probe]
            hidden += min(end, ends[step]) - max(begin, starts[step])
            probe += 1
    return total, hidden


def critical_path(program: Program, timing: Timing) -> list[tuple[int, int]]:
    """The (rank, step) chain that ends last, first to last.

    Walks back from the action that ends last, each time to the predecessor
    whose end equals the action's start: the same rank's previous compute
    first, then an UNSHARD, then a transfer.
    """
    starts, ends, codes = timing.starts, timing.ends, program.codes
    best = (-1.0, 0, 0)
    for rank, row in enumerate(ends):
        for step, end in enumerate(row):
            if end > best[0]:
                best = (end, rank, step)
    if best[0] < 0.0:
        return []
    path: list[tuple[int, int]] = []
    rank, step = best[1], best[2]
    while True:
        path.append((rank, step))
        begin = starts[rank][step]
        if begin == 0.0:
            break
        transfer = program.transfer_of[rank][step]
        kind = codes[rank][step]
        if transfer >= 0:
            candidates = _transfer_causes(program, timing, transfer)
        elif kind <= OVERLAP:
            candidates = [(rank, _last_before(codes[rank], step, COMPUTE))]
            candidates += [(rank, other) for other in program.unshard_waits[rank].get(step, ())]
            candidates += [program.sender[t] for t in program.transfers_waited(rank, step)]
        else:
            candidates = [
                (rank, _last_before(codes[rank], step, COMPUTE)),
                (rank, _last_before(codes[rank], step, STAGE_WIDE)),
            ]
        found = next(((r, s) for r, s in candidates if s >= 0 and ends[r][s] == begin), None)
        assert found is not None, f"no predecessor ends when rank {rank} step {step} starts"
        rank, step = found
    path.reverse()
    return path


def _transfer_causes(program: Program, timing: Timing, transfer: int) -> list[tuple[int, int]]:
    send_rank, send_step = program.sender[transfer]
    recv_rank, recv_step = program.receiver[transfer]
    begin = timing.transfer_start[transfer]
    causes = []
    if timing.posted_send[transfer] == begin:
        causes.append((send_rank, _last_before(program.codes[send_rank], send_step, COMPUTE)))
    if timing.posted_recv[transfer] == begin:
        causes.append((recv_rank, _last_before(program.codes[recv_rank], recv_step, COMPUTE)))
    before = program.previous[transfer]
    if before >= 0:
        causes.append(program.sender[before])
    return causes


def _last_before(codes: list[int], step: int, kinds: frozenset[int]) -> int:
    for index in range(step - 1, -1, -1):
        if codes[index] in kinds:
            return index
    return -1
