"""V-shaped schedules: two stages per rank, stage r and stage 2p-1-r on rank r.

ZB-V and DualPipeV order their actions exactly as torch.distributed.pipelining's
ScheduleZBVZeroBubble and ScheduleDualPipeV do; V-Half and V-Min (Qi et al.,
"Pipeline Parallelism with Controllable Memory", 2024) are built by the list
scheduler on unit costs under their memory bounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

from octopipe.ir import Action, ActionKind
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import simulate
from octopipe.tune.listsched import ListSchedulerConfig, list_schedule
from octopipe.tune.schedules import check_schedule_args, compute_plan, unit_costs

__all__ = ["dualpipe_v", "v_half", "v_min", "v_placement", "zb_v"]

_F, _I, _W, _B = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD


def v_placement(num_ranks: int) -> list[int]:
    """Stage -> rank for the V shape: stages 0..p-1 on ranks 0..p-1, then back from p-1 to 0."""
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks)]


def _v_plan(
    name: str, compute: dict[int, list[Action]], p: int, m: int, layer_names: Sequence[Sequence[str]] | None
) -> plan_pb2.Plan:
    return compute_plan(
        name, compute, p, m, layer_names, num_chunks=2, placement=v_placement(p), labels={"placement": "v"}
    )


def _check_v(p: int, m: int, layer_names: Sequence[Sequence[str]] | None) -> None:
    check_schedule_args(p, m, layer_names, num_chunks=2)


def zb_v(num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None) -> plan_pb2.Plan:
    """ZB-V (Zero Bubble, section 6; torch's ScheduleZBVZeroBubble): V placement, I/W split.

    Rank r warms up with 2(p-r)-1 forwards of its first stage, then r pairs
    of both stages' forwards, then p-r rounds of (F, I, W) on its second
    stage; in the steady state it alternates F, I, W on each stage; it cools
    down with the remaining I's and fills the tail with W's. As in torch,
    the order is laid out for max(m, 2p-1) micro-batches and the ones beyond
    m are dropped. At most p micro-batches' activations per rank (1F1B's peak).
    """
    p, m = num_ranks, num_microbatches
    _check_v(p, m, layer_names)
    n = max(2 * p - 1, m)
    compute: dict[int, list[Action]] = {}
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        count = {(s, k): 0 for s in (first, second) for k in (_F, _I, _W)}
        ops: list[Action] = []

        def add(
            stage: int, kind: ActionKind, ops: list[Action] = ops, count: dict[tuple[int, ActionKind], int] = count
        ) -> None:
            ops.append(Action(kind, stage, count[stage, kind]))
            count[stage, kind] += 1

        for _ in range(2 * (p - r) - 1):
            add(first, _F)
        for _ in range(r):
            add(second, _F)
            add(first, _F)
        for _ in range(p - r):
            add(second, _F)
            add(second, _I)
            add(second, _W)
        while count[second, _F] < count[first, _F] or count[first, _F] < n:
            if count[first, _F] < n:
                add(first, _F)
            add(first, _I)
            add(first, _W)
            add(second, _F)
            add(second, _I)
            add(second, _W)
        for _ in range(r):
            add(first, _I)
            add(second, _I)
        for _ in range(p - r):
            add(first, _I)
            add(first, _W)
        while count[second, _W] < count[second, _I]:
            add(second, _W)
        while count[first, _W] < count[first, _I]:
            add(first, _W)
        compute[r] = [a for a in ops if a.microbatch is not None and a.microbatch < m]
    return _v_plan("zb-v", compute, p, m, layer_names)


def dualpipe_v(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV): V placement, OVERLAP_F_B.

    In its steady state each rank runs a forward of one stage overlapped with
    a full backward of its other stage (``(0F3;7B1)OVERLAP_F_B``), so that one
    hides the other's communication; warm-up and cool-down use the I/W split.
    Needs m >= 2p (the number of stages).
    """
    p, m = num_ranks, num_microbatches
    _check_v(p, m, layer_names)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least as many micro-batches as stages (2p = {2 * p}), got {m}: "
            f"use num_microbatches >= {2 * p} or fewer ranks"
        )
    compute: dict[int, list[Action]] = {}
    for r in range(p):
        compute[r] = _dualpipe_v_rank(p, m, r)
    return _v_plan("dualpipe-v", compute, p, m, layer_names)


def _dualpipe_v_rank(p: int, m: int, r: int) -> list[Action]:
    first, second = r, 2 * p - 1 - r
    ops: list[Action] = []
    forwards = {first: 0, second: 0}
    inputs = {first: 0, second: 0}  # backwards (B or I) so far
    weights: deque[tuple[int, int]] = deque()

    def forward(stage: int) -> Action:
        forwards[stage] += 1
        return Action(_F, stage, forwards[stage] - 1)

    def backward(stage: int, kind: ActionKind) -> Action:
        inputs[stage] += 1
        if kind is _I:
            weights.append((stage, inputs[stage] - 1))
        return Action(kind, stage, inputs[stage] - 1)

    def overlap(forward_stage: int, backward_stage: int) -> None:
        parts = (forward(forward_stage), backward(backward_stage, _B))
        ops.append(Action(ActionKind.OVERLAP_F_B, sub_actions=parts))

    def weight() -> None:
        if weights:
            stage, mb = weights.popleft()
            ops.append(Action(_W, stage, mb))

    ops.extend(forward(first) for _ in range(2 * (p - r - 1)))
    for _ in range(r + 1):
        ops.append(forward(first))
        ops.append(forward(second))
    for _ in range(p - r - 1):
        ops.append(backward(second, _I))
        weight()
        ops.append(forward(second))
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # not overlapped, to shorten the bubble (as torch and DualPipe do)
            ops.append(forward(first))
            ops.append(backward(second, _B))
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(p - r - 1):
        ops.append(backward(second, _B))
        overlap(second, first)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        ops.append(backward(second, _I if split else _B))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        ops.append(backward(first, _I if split else _B))
    for _ in range(p - r - 1):
        weight()
        ops.append(backward(first, _I if split else _B))
    for _ in range(r + 1):
        weight()
    return ops


def v_half(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """V-Half: V placement, at most (p+2)//2 micro-batches' activations per rank (about half of 1F1B's p)."""
    return _controllable("v-half", num_ranks, num_microbatches, (num_ranks + 2) // 2, layer_names)


def v_min(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """V-Min: V placement, at most (p+4)//3 micro-batches' activations per rank (about a third of 1F1B's p)."""
    return _controllable("v-min", num_ranks, num_microbatches, (num_ranks + 4) // 3, layer_names)


def _controllable(name: str, p: int, m: int, limit: int, layer_names: Sequence[Sequence[str]] | None) -> plan_pb2.Plan:
    """The list scheduler on unit costs with a cap of ``limit`` micro-batches (2·limit stage activations) per rank.

    Of the scheduler's policies (backward or forward first, memory reserved
    per micro-batch or taken per stage) it keeps the one with the shortest
    unit-cost step; the result depends only on (p, m).
    """
    _check_v(p, m, layer_names)
    placement = v_placement(p)
    costs = unit_costs(2 * p)
    caps = dict.fromkeys(range(p), 2 * limit)
    best: tuple[float, int, dict[int, list[Action]]] | None = None
    policies: list[tuple[Literal["backward", "forward"], bool]] = [
        ("backward", False),
        ("forward", False),
        ("backward", True),
        ("forward", True),
    ]
    for index, (priority, reserve) in enumerate(policies):
        config = ListSchedulerConfig(priority=priority, reserve_memory=reserve)
        compute = list_schedule(costs, placement, m, memory_caps=caps, config=config)
        plan = _v_plan(name, compute, p, m, None)
        estimate = simulate(plan, costs).estimate
        if max(rank.peak_activation_bytes for rank in estimate.ranks) > 2 * limit:
            continue
        if best is None or estimate.step_time_us < best[0]:
            best = (estimate.step_time_us, index, compute)
    assert best is not None  # reserving memory never goes over the cap
    return _v_plan(name, best[2], p, m, layer_names)
