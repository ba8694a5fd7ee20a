"""Schedule generators: functions that return each rank's actions.

A schedule is data, never control flow: each generator returns a Plan whose
rank programs the one simulator scores and the one runtime interprets.
One stage per rank or interleaved: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and
ZB-H2 (the V-shaped ones are in :mod:`octopipe.tune.vshape`). Interleaved 1F1B
and ZB-H1 order their actions exactly as torch.distributed.pipelining's
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (one stage per rank)
do.
"""

from __future__ import annotations

from collections.abc import Sequence

from octopipe.ir import Action, ActionKind, StageSpec, add_p2p_actions, build_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import CostModel, StageCost
from octopipe.tune.listsched import ListSchedulerConfig, list_schedule

__all__ = [
    "check_schedule_args",
    "compute_plan",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "unit_costs",
    "zb_h1",
    "zb_h2",
]


def check_schedule_args(
    num_ranks: int, num_microbatches: int, layer_names: Sequence[Sequence[str]] | None, num_chunks: int = 1
) -> None:
    """A generator's arguments: ValueError saying what to change (``num_chunks`` stages per rank)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if layer_names is not None and len(layer_names) != num_ranks * num_chunks:
        if num_chunks == 1:
            raise ValueError(
                f"layer_names has {len(layer_names)} stages; these schedules need one stage per rank ({num_ranks})"
            )
        raise ValueError(
            f"layer_names has {len(layer_names)} stages; interleaving {num_chunks} chunks on {num_ranks} ranks "
            f"needs {num_ranks * num_chunks}"
        )


def compute_plan(
    name: str,
    compute: dict[int, list[Action]],
    num_ranks: int,
    num_microbatches: int,
    layer_names: Sequence[Sequence[str]] | None,
    *,
    num_chunks: int = 1,
    labels: dict[str, str] | None = None,
    placement: Sequence[int] | None = None,
) -> plan_pb2.Plan:
    """A generator's Plan from each rank's compute actions: p2p added, named ``<name>-p<p>[-v<chunks>]-m<m>``,
    labelled ``schedule=<name>``; stage s on ``placement[s]`` (default: rank s % p)."""
    num_stages = num_ranks * num_chunks
    ranks = dict(enumerate(placement)) if placement is not None else {s: s % num_ranks for s in range(num_stages)}
    stages = [
        StageSpec(rank=ranks[s], layer_names=tuple(layer_names[s]) if layer_names else ()) for s in range(num_stages)
    ]
    chunks = f"-v{num_chunks}" if num_chunks > 1 else ""
    return build_plan(
        stages=stages,
        actions=add_p2p_actions(compute, ranks),
        num_microbatches=num_microbatches,
        name=f"{name}-p{num_ranks}{chunks}-m{num_microbatches}",
        labels={"schedule": name, **(labels or {})},
    )


def gpipe(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """GPipe: every forward, then every backward (stage s on rank s)."""
    check_schedule_args(num_ranks, num_microbatches, layer_names)
    compute = {
        r: [Action(ActionKind.FORWARD, r, mb) for mb in range(num_microbatches)]
        + [Action(ActionKind.FULL_BACKWARD, r, mb) for mb in range(num_microbatches)]
        for r in range(num_ranks)
    }
    return compute_plan("gpipe", compute, num_ranks, num_microbatches, layer_names)


def one_f_one_b(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """1F1B: rank r warms up with p-r-1 forwards, then alternates F and B, then drains."""
    check_schedule_args(num_ranks, num_microbatches, layer_names)
    compute: dict[int, list[Action]] = {}
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, num_microbatches)
        program = [Action(ActionKind.FORWARD, r, mb) for mb in range(warmup)]
        for i in range(num_microbatches - warmup):
            program.append(Action(ActionKind.FORWARD, r, warmup + i))
            program.append(Action(ActionKind.FULL_BACKWARD, r, i))
        program.extend(
            Action(ActionKind.FULL_BACKWARD, r, mb) for mb in range(num_microbatches - warmup, num_microbatches)
        )
        compute[r] = program
    return compute_plan("1f1b", compute, num_ranks, num_microbatches, layer_names)


def interleaved_1f1b(
    num_ranks: int,
    num_chunks: int,
    num_microbatches: int,
    *,
    layer_names: Sequence[Sequence[str]] | None = None,
) -> plan_pb2.Plan:
    """Interleaved 1F1B (Megatron-LM's; torch's ScheduleInterleaved1F1B): v chunks per rank.

    Stage c*p + r runs on rank r. Micro-batches go in rounds of
    ``m // max(1, m // p)`` (p when m is a multiple of p); rank r warms up with
    ``(v-1)*round + 2*(p-1-r)`` forwards (at most m*v), then alternates F and B,
    forwards cycling through its chunks in order and backwards in reverse.
    """
    p, v, m = num_ranks, num_chunks, num_microbatches
    check_schedule_args(p, m, layer_names, v)
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in {rounds} equal rounds, so num_microbatches ({m}) must be "
            f"a multiple of {rounds}: use a multiple of num_ranks ({p}) or at most {p}"
        )
    per_round = m // rounds
    compute: dict[int, list[Action]] = {}
    for r in range(p):
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), m * v)
        forwards = [(k // per_round) % v * p + r for k in range(m * v)]
        backwards = [(v - 1 - (k // per_round) % v) * p + r for k in range(m * v)]
        compute[r] = _one_f_one_b_order(forwards, backwards, warmup)
    return compute_plan("interleaved-1f1b", compute, p, m, layer_names, num_chunks=v)


def zb_h1(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """ZB-H1 (Zero Bubble, Qi et al. 2024; torch's ZB1P with one stage per rank).

    Backwards are split into I (input gradient) and W (weight gradient). Rank r
    warms up with min(p-r-1, m) forwards like 1F1B, then runs F, I pairs, and
    from its (r+1)-th pair on follows each with the oldest pending W; the W's
    left over run last. In-flight activations never exceed 1F1B's peak (p
    micro-batches, on rank 0).
    """
    p, m = num_ranks, num_microbatches
    check_schedule_args(p, m, layer_names)
    compute: dict[int, list[Action]] = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        program = [Action(ActionKind.FORWARD, r, mb) for mb in range(warmup)]
        weights = 0
        for k in range(m):  # the k-th input backward, with the forward it pairs with
            if warmup + k < m:
                program.append(Action(ActionKind.FORWARD, r, warmup + k))
            program.append(Action(ActionKind.BACKWARD_INPUT, r, k))
            if k >= r:
                program.append(Action(ActionKind.BACKWARD_WEIGHT, r, weights))
                weights += 1
        program.extend(Action(ActionKind.BACKWARD_WEIGHT, r, mb) for mb in range(weights, m))
        compute[r] = program
    return compute_plan("zb-h1", compute, p, m, layer_names)


def zb_h2(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """ZB-H2 (Zero Bubble, Qi et al. 2024): more warm-up forwards, weight gradients moved to the tail.

    Rank r runs forwards while fewer than 2(p-r)-1 of its micro-batches wait
    for their input backward and fewer than 2p-1 for their weight backward
    (the memory bound: up to 2p-1 micro-batches' activations on every rank), a
    ready forward before a ready I, and a W whenever nothing else is ready.
    The order is built once on unit costs (F = I = W) by the list scheduler
    and is independent of the real costs. Each rank's span (first start to
    last end, the step time when consecutive steps overlap at the optimizer)
    is m(F+B+W) plus at most (p-1)(F+B-2W) (0 when F = B = W).
    """
    p, m = num_ranks, num_microbatches
    check_schedule_args(p, m, layer_names)
    config = ListSchedulerConfig(
        priority="forward", max_in_flight=[2 * p - 1] * p, max_ahead=[2 * (p - r) - 1 for r in range(p)]
    )
    compute = list_schedule(unit_costs(p), list(range(p)), m, config=config)
    return compute_plan("zb-h2", compute, p, m, layer_names)


def unit_costs(num_stages: int) -> CostModel:
    """F = I = W = 1 us and 1 activation byte per stage, free links: the cost model schedules are shaped on."""
    return CostModel.uniform(
        num_stages=num_stages,
        stage=StageCost(forward_us=1.0, backward_input_us=1.0, backward_weight_us=1.0, activation_bytes=1),
    )


def _one_f_one_b_order(forwards: list[int], backwards: list[int], warmup: int) -> list[Action]:
    """Warm-up forwards, then F/B pairs, then the remaining backwards; micro-batches count up per stage."""
    next_forward: dict[int, int] = {}
    next_backward: dict[int, int] = {}

    def forward(k: int) -> Action:
        stage = forwards[k]
        next_forward[stage] = next_forward.get(stage, -1) + 1
        return Action(ActionKind.FORWARD, stage, next_forward[stage])

    def backward(k: int) -> Action:
        stage = backwards[k]
        next_backward[stage] = next_backward.get(stage, -1) + 1
        return Action(ActionKind.FULL_BACKWARD, stage, next_backward[stage])

    program = [forward(k) for k in range(warmup)]
    for k in range(len(forwards) - warmup):
        program.append(forward(warmup + k))
        program.append(backward(k))
    program.extend(backward(k) for k in range(len(forwards) - warmup, len(backwards)))
    return program
