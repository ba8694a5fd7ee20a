"""Costs bound to a compiled program: a duration and memory deltas for every step.

Plans with a mesh of dp > 1 (data parallelism; see ``octopipe.ir.mesh``):

* time: with ``CostModel.collectives`` set, UNSHARD is a ring all-gather of
  the stage's unsharded bytes and REDUCE_GRAD a ring reduce-scatter of its
  gradient bytes over the pipeline rank's data-parallel group; with ep > 1
  each F, I and B also pays its stage's MoE all-to-alls over the
  expert-parallel group (a unit of OVERLAP_F_B takes the longer of its compute
  and its two halves' all-to-alls: each half's all-to-all runs under the other
  half's compute). Formulas: ``octopipe.simulate.collectives``. Measured
  ``durations_us`` win over all of this.
* expert parallelism (ep > 1): of a stage's bytes, the experts' share
  (``StageCost.expert_parameter_bytes`` / ``parameter_bytes``, the same share of
  gradients and optimizer state) is split over the ep group: a rank holds whole
  the dense part and 1/ep of the experts; UNSHARD / REDUCE_GRAD move the dense
  part over the dp group and the rank's experts over the dp/ep replicas that
  share them (two collectives, one after the other; the second timed with the
  data-parallel link for a group of dp/ep ranks);
* memory: with dp > 1 every stage is sharded (FSDP; the program compiler
  requires its UNSHARD, as the runtime does): its parameters, gradients
  and optimizer state count 1/dp (rounded up) as static bytes (experts
  included: 1/ep of them over dp/ep replicas is also 1/dp); UNSHARD holds
  the unsharded parameters until RESHARD (as without a mesh); its unsharded
  gradients are held from the start of its first weight-gradient computation
  (W, B, or an OVERLAP_F_B with a B of it) until REDUCE_GRAD ends, after which
  only the sharded gradients (in the static bytes) remain; unsharded means the
  rank's share (dense + experts / ep).

Tensor and context parallelism (tp or cp > 1; ``octopipe.simulate.tensor_parallel``):
the stages' costs are already one (tensor rank, context rank)'s share; with
``CostModel.collectives`` set, each stage's TP all-reduces and CP all-gathers /
reduce-scatters are added to its F, I and B (tp group: ``tp`` consecutive
ranks; cp group: ``cp`` ranks spanning ``cp * tp``), an OVERLAP_F_B unit
takes the longer of its compute and its halves' traffic, and the per-step
all-reduce of the stage's gradients over cp (its FSDP shard with dp > 1) is
added to its REDUCE_GRAD, or, for a stage without one, to the step's tail. The
data- and expert-parallel groups then span ``cp * tp`` times as many ranks
(their link is looked up by that span).

Without a mesh (or with dp = ep = tp = cp = 1) nothing here changes a duration or a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from octopipe.ir.actions import ActionKind
from octopipe.ir.program import (
    COMPUTE,
    OVERLAP,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    B,
    F,
    I,
    Program,
    W,
)
from octopipe.simulate.collectives import all_gather_us, all_to_all_us, bucketed_us, reduce_scatter_us
from octopipe.simulate.costs import CostModel, StageCost
from octopipe.simulate.tensor_parallel import gradient_all_reduce_us, traffic_us

__all__ = ["Bound", "bind"]

_COLLECTIVES = frozenset({UNSHARD, REDUCE_GRAD})
_KINDS: dict[int, ActionKind] = {
    F: ActionKind.FORWARD,
    I: ActionKind.BACKWARD_INPUT,
    W: ActionKind.BACKWARD_WEIGHT,
    B: ActionKind.FULL_BACKWARD,
    UNSHARD: ActionKind.UNSHARD,
    REDUCE_GRAD: ActionKind.REDUCE_GRAD,
}


_P2P: dict[int, ActionKind] = {
    SEND_F: ActionKind.SEND_F,
    RECV_F: ActionKind.RECV_F,
    SEND_B: ActionKind.SEND_B,
    RECV_B: ActionKind.RECV_B,
}


@dataclass(eq=False)
class Bound:
    """Per step: duration (a compute action's includes what posting the SENDs and RECVs after it costs the
    program, ``_fold_posting``), activation bytes allocated at its start and freed at its end (compute),
    other bytes taken (+) or given back (-) at its start (``unsharded``: UNSHARD to RESHARD, unsharded
    gradients) and given back at its end (``released``: gradients after REDUCE_GRAD); per transfer:
    duration and bytes; per rank: static bytes."""

    durations: list[list[float]]
    allocs: list[list[int]]
    frees: list[list[int]]
    unsharded: list[list[int]]
    released: list[list[int]]
    #: per step: bytes a compute action allocates and frees again before it ends (held start to end)
    scratch: list[list[int]]
    transfer_us: list[float]
    transfer_bytes: list[int]
    static_bytes: list[int]
    microbatch_size: int
    #: the tied-parameter exchange after every rank's last action (CostModel.tied): its duration and, per
    #: rank, the broadcast buffers it holds meanwhile
    tail_us: float = 0.0
    tail_bytes: tuple[int, ...] = ()


def bind(program: Program, costs: CostModel) -> Bound:
    """Look every step's cost up once, so the engine never touches the cost model."""
    num_stages = program.num_stages
    if len(costs.stages) != num_stages:
        raise ValueError(
            f"the cost model has {len(costs.stages)} stages but the plan has {num_stages}: give one StageCost per stage"
        )
    # a compute action's work plus the runtime's dispatch of it (CostModel.action_us; collectives: their time)
    table: dict[tuple[int, int], float] = {
        (s, code): costs.action_us(s, kind) for s in range(num_stages) for code, kind in _KINDS.items()
    }
    a2a = [0.0] * num_stages
    mesh = program.plan.mesh if program.plan.HasField("mesh") else None
    tp, cp = (mesh.tp or 1, mesh.cp or 1) if mesh is not None else (1, 1)
    if costs.collectives is not None and (program.dp > 1 or program.ep > 1):
        a2a = _mesh_durations(program, costs, table, tp * cp)
    exchange_f, exchange_b, parallel_tail = a2a, a2a, 0.0
    if any(stage.parallel is not None for stage in costs.stages):
        sp = mesh is not None and mesh.sequence_parallel
        exchange_f, exchange_b, parallel_tail = _parallel_durations(program, costs, table, (tp, cp, sp), a2a)
    saved = [stage.activation_bytes for stage in costs.stages]
    freed_by_input = [stage.freed_by_backward_input_bytes for stage in costs.stages]
    unsharded_bytes = [
        _local(stage, _held(stage), program.ep) if program.dp > 1 else _held(stage) for stage in costs.stages
    ]
    kept = [stage.kept_for_weight_bytes for stage in costs.stages]  # I makes them, W frees them
    frees_by_kind: dict[int, list[int]] = {
        F: [0] * num_stages,
        I: freed_by_input,
        W: [saved[s] - freed_by_input[s] + kept[s] for s in range(num_stages)],
        B: saved,
    }
    scratch_by_kind: dict[int, list[int]] = {
        F: [stage.forward_scratch_bytes for stage in costs.stages],
        I: [stage.backward_input_scratch_bytes for stage in costs.stages],
        W: [stage.backward_weight_scratch_bytes for stage in costs.stages],
        B: [stage.full_backward_scratch_bytes for stage in costs.stages],
    }
    # a stage's first W (or B) in the step returns the gradients that become its accumulated ones, which the
    # static bytes already count: only later ones hold a second, transient copy
    gradient_bytes = [stage.gradient_bytes for stage in costs.stages]
    # a tied parameter's holder keeps each micro-batch's gradient apart (the exchange needs them): every W
    # (or B) after the stage's first keeps one more copy until the step ends
    tied_bytes = [0] * num_stages
    for exchange in costs.tied:
        for stage in exchange.stages:
            tied_bytes[stage] += exchange.size_bytes
    overlap_cache: dict[tuple[int, int, int], float] = {}
    overlap_dispatch = costs.runtime.dispatch(ActionKind.OVERLAP_F_B)
    posting = not costs.runtime.is_zero
    outputs = [stage.output_bytes for stage in costs.stages]
    transfer_bytes = [outputs[s] for s in program.boundary_stage]
    durations, allocs, frees, unsharded, scratch = [], [], [], [], []
    for rank, row in enumerate(program.labels):
        accumulating: set[int] = set()
        d_row = [0.0] * len(row)
        a_row = [0] * len(row)
        f_row = [0] * len(row)
        u_row = [0] * len(row)
        s_row = [0] * len(row)
        for step, label in enumerate(row):
            kind = label[0]
            if kind <= B:
                stage = label[1]
                d_row[step] = table[stage, kind]
                s_row[step] = scratch_by_kind[kind][stage]
                kept_apart = 0
                if kind in (W, B):
                    if stage in accumulating:
                        kept_apart = tied_bytes[stage]
                    else:
                        accumulating.add(stage)
                        s_row[step] = max(0, s_row[step] - gradient_bytes[stage])
                if kind == F:
                    a_row[step] = saved[stage]
                else:
                    a_row[step] = (kept[stage] if kind == I else 0) + kept_apart
                    f_row[step] = frees_by_kind[kind][stage]
            elif kind == OVERLAP:
                key = (label[1], label[4], label[3])
                if key not in overlap_cache:
                    unit = costs.overlap_us(label[1], label[4], _KINDS[label[3]])
                    exchanged = exchange_f[label[1]] + exchange_b[label[4]]
                    overlap_cache[key] = (exchanged if exchanged > unit else unit) + overlap_dispatch
                d_row[step] = overlap_cache[key]
                a_row[step] = saved[label[1]] + (kept[label[4]] if label[3] == I else 0)
                f_row[step] = frees_by_kind[label[3]][label[4]]
                backward = scratch_by_kind[label[3]][label[4]]
                if label[3] in (W, B) and label[4] in accumulating:
                    a_row[step] += tied_bytes[label[4]]
                elif label[3] in (W, B):
                    accumulating.add(label[4])
                    backward = max(0, backward - gradient_bytes[label[4]])
                s_row[step] = scratch_by_kind[F][label[1]] + backward
            elif kind in _COLLECTIVES:
                d_row[step] = table[label[1], kind]
                if kind == UNSHARD:
                    u_row[step] = unsharded_bytes[label[1]]
            elif kind == RESHARD:
                u_row[step] = -unsharded_bytes[label[1]]
        if posting:
            _fold_posting(row, d_row, [program.transfer_of[rank], transfer_bytes], costs)
        durations.append(d_row)
        allocs.append(a_row)
        frees.append(f_row)
        unsharded.append(u_row)
        scratch.append(s_row)
    link_cache: dict[tuple[int, int, int], float] = {}
    transfer_us = []
    for (source, _), (destination, _), size in zip(program.sender, program.receiver, transfer_bytes, strict=True):
        key = (source, destination, size)
        if key not in link_cache:
            link_cache[key] = costs.message_us(source, destination, size)
        transfer_us.append(link_cache[key])
    static = [0] * program.num_ranks
    released = [[0] * len(row) for row in program.labels]
    for stage, rank in enumerate(program.placement):
        cost = costs.stages[stage]
        if program.dp > 1:  # every stage is sharded (compile_plan requires its UNSHARD)
            assert stage in program.sharded_stages
            static[rank] += _sharded_static(cost, program.dp)
            gradients = _local(cost, cost.gradient_bytes, program.ep)
            _hold_gradients(program, rank, stage, gradients, unsharded[rank], released[rank])
        else:
            static[rank] += cost.static_bytes
    tail_us, tail_bytes = _tied_tail(program, costs)
    if parallel_tail:
        tail_us += parallel_tail
    return Bound(
        tail_us=tail_us,
        tail_bytes=tail_bytes,
        durations=durations,
        allocs=allocs,
        frees=frees,
        unsharded=unsharded,
        released=released,
        scratch=scratch,
        transfer_us=transfer_us,
        transfer_bytes=transfer_bytes,
        static_bytes=static,
        microbatch_size=costs.microbatch_size,
    )


def _mesh_durations(
    program: Program, costs: CostModel, table: dict[tuple[int, int], float], span: int = 1
) -> list[float]:
    """Time collectives by group size in ``table``; return each stage's all-to-all time per F (or I, B).
    ``span``: cp x tp, the stride of the data-parallel groups' ranks (their links are looked up by span)."""
    links = costs.collectives
    assert links is not None
    measured = costs.durations_us
    buckets = costs.bucket_bytes
    a2a = [0.0] * program.num_stages
    for stage, rank in enumerate(program.placement):
        cost = costs.stages[stage]
        if program.dp > 1:
            dp, ep = program.dp, program.ep
            dense_link = links.data_parallel_link(rank, dp * span)
            expert_link = links.data_parallel_link(rank, dp // ep * span)
            if (stage, ActionKind.UNSHARD) not in measured:
                held = _held(cost)
                expert = _expert_part(cost, held) if ep > 1 else 0
                table[stage, UNSHARD] = bucketed_us(all_gather_us, dense_link, dp, held - expert, buckets)
                if expert:
                    table[stage, UNSHARD] += all_gather_us(expert_link, dp // ep, -(-expert // ep))
            if (stage, ActionKind.REDUCE_GRAD) not in measured:
                expert = _expert_part(cost, cost.gradient_bytes) if ep > 1 else 0
                dense = cost.gradient_bytes - expert
                table[stage, REDUCE_GRAD] = bucketed_us(reduce_scatter_us, dense_link, dp, dense, buckets)
                if expert:
                    table[stage, REDUCE_GRAD] += reduce_scatter_us(expert_link, dp // ep, -(-expert // ep))
        if program.ep > 1 and cost.all_to_all_bytes:
            link = links.expert_parallel_link(rank, program.ep * span)
            a2a[stage] = all_to_all_us(link, program.ep, cost.all_to_all_bytes)
            for code in (F, I, B):
                if (stage, _KINDS[code]) not in measured:
                    table[stage, code] += a2a[stage]
    return a2a


def _parallel_durations(
    program: Program,
    costs: CostModel,
    table: dict[tuple[int, int], float],
    degrees: tuple[int, int, bool],
    a2a: list[float],
) -> tuple[list[float], list[float], float]:
    """Add each stage's TP/CP traffic to its F, I, B (and the cp / sequence-parallel gradient all-reduces to its
    REDUCE_GRAD) in ``table``; return per stage what F and what I/B exchange (all-to-alls included) and the
    step's tail. ``degrees``: the mesh's (tp, cp, sequence_parallel)."""
    tp, cp, sp = degrees
    exchange_f, exchange_b = list(a2a), list(a2a)
    for stage, cost in enumerate(costs.stages):
        if cost.parallel is not None and (cost.parallel.tp, cost.parallel.cp, cost.parallel.sequence_parallel) != (
            tp,
            cp,
            sp,
        ):
            raise ValueError(
                f"stage {stage}'s costs are for tp={cost.parallel.tp}, cp={cost.parallel.cp}, sequence parallel "
                f"{cost.parallel.sequence_parallel}, but the plan's mesh has tp={tp}, cp={cp}, sequence parallel {sp}: "
                "build the cost model from this plan (CostModel.from_profile)"
            )
    links = costs.collectives
    if links is None:  # as for all-to-alls: no group costs, no collective time
        return exchange_f, exchange_b, 0.0
    measured = costs.durations_us
    reduced = {label[1] for row in program.labels for label in row if label[0] == REDUCE_GRAD}
    tail = [0.0] * program.num_ranks
    for stage, rank in enumerate(program.placement):
        cost = costs.stages[stage]
        if cost.parallel is None:
            continue
        tp_link = links.tensor_parallel_link(rank, tp) if tp > 1 else None
        cp_link = links.context_parallel_link(rank, cp, cp * tp) if cp > 1 else None
        forward, backward = traffic_us(cost.parallel, tp_link, cp_link)
        exchange_f[stage] += forward
        exchange_b[stage] += backward
        for code, extra in ((F, forward), (I, backward), (B, backward)):
            if extra and (stage, _KINDS[code]) not in measured:
                table[stage, code] += extra
        reduce_us = 0.0
        if cp_link is not None:
            size = -(-cost.gradient_bytes // program.dp)  # after REDUCE_GRAD an FSDP stage holds its shard
            reduce_us += gradient_all_reduce_us(cp_link, cp, size)
        if tp_link is not None and cost.parallel.replicated_gradient_bytes:  # sequence parallelism's average
            size = -(-cost.parallel.replicated_gradient_bytes // program.dp)
            reduce_us += gradient_all_reduce_us(tp_link, tp, size)
        if reduce_us:
            if stage not in reduced:
                tail[rank] += reduce_us
            elif (stage, ActionKind.REDUCE_GRAD) not in measured:
                table[stage, REDUCE_GRAD] += reduce_us
    return exchange_f, exchange_b, max(tail)


def _held(cost: StageCost) -> int:
    """What UNSHARD gathers and holds: ``unsharded_bytes``, else the parameter bytes."""
    return cost.parameter_bytes if cost.unsharded_bytes is None else cost.unsharded_bytes


def _expert_part(cost: StageCost, size: int) -> int:
    """Of ``size`` bytes (parameters, gradients, optimizer state), the experts' share."""
    if not cost.expert_parameter_bytes or not cost.parameter_bytes:
        return 0
    return size * cost.expert_parameter_bytes // cost.parameter_bytes


def _local(cost: StageCost, size: int, ep: int) -> int:
    """Of ``size`` bytes, what one rank holds whole with ep-way expert parallelism: dense + experts / ep."""
    if ep == 1:
        return size
    expert = _expert_part(cost, size)
    return size - expert + -(-expert // ep)


def _sharded_static(cost: StageCost, dp: int) -> int:
    """Parameters, gradients and optimizer state of an FSDP stage: 1/dp of each, rounded up."""
    return sum(-(-size // dp) for size in (cost.parameter_bytes, cost.gradient_bytes, cost.optimizer_state_bytes))


def _hold_gradients(program: Program, rank: int, stage: int, size: int, taken: list[int], given: list[int]) -> None:
    """Unsharded gradients of an FSDP stage: from its first weight-gradient step to the end of its REDUCE_GRAD."""
    if not size:
        return
    first = -1
    for step, label in enumerate(program.labels[rank]):
        kind = label[0]
        if first < 0 and (
            (kind in (W, B) and label[1] == stage) or (kind == OVERLAP and label[3] == B and label[4] == stage)
        ):
            first = step
            taken[step] += size
        elif kind == REDUCE_GRAD and label[1] == stage and first >= 0:
            given[step] += size
            return


def _tied_tail(program: Program, costs: CostModel) -> tuple[float, tuple[int, ...]]:
    """The closing exchange of tied gradients: one broadcast of m x size per holding stage, over every
    rank (timed by the slowest link from the holder), and the buffers every rank holds meanwhile."""
    if not costs.tied:
        return 0.0, ()
    m, ranks = program.num_microbatches, program.num_ranks
    tail_us, held = 0.0, 0
    for exchange in costs.tied:
        size = m * exchange.size_bytes
        for stage in exchange.stages:
            source = program.placement[stage]
            others = [r for r in range(ranks) if r != source]
            tail_us += max((costs.link(source, r).transfer_us(size) for r in others), default=0.0)
            held += size
    return tail_us, (held,) * ranks


def _fold_posting(row: list[tuple[int, ...]], d_row: list[float], where: list[list[int]], costs: CostModel) -> None:
    """Charge what posting each SEND and RECV costs the rank's program (``CostModel.posting_us``: the runtime's
    dispatch of it and its share of the message's CPU work) to the compute action before it, whose end the
    post then follows (a SEND leaves after its own posting); posts before the first compute action delay
    that action. ``where``: the row's transfer ids and every transfer's bytes."""
    transfer_of, transfer_bytes = where
    last, pending = -1, 0.0
    for step, label in enumerate(row):
        kind = label[0]
        if kind in _P2P:
            cost = costs.posting_us(_P2P[kind], transfer_bytes[transfer_of[step]])
            if last >= 0:
                d_row[last] += cost
            else:
                pending += cost
        elif kind in COMPUTE:
            if last < 0:
                d_row[step] += pending
            last = step
