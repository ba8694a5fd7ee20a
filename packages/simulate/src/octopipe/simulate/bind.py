"""Costs bound to a compiled program: a duration and memory deltas for every step."""

from __future__ import annotations

from dataclasses import dataclass

from octopipe.simulate.costs import CostModel
from octopipe.simulate.ir.actions import ActionKind
from octopipe.simulate.program import (
    OVERLAP,
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
    B,
    F,
    I,
    Program,
    W,
)

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


@dataclass(eq=False)
class Bound:
    """Per step: duration, bytes allocated at its start and freed at its end (compute),
    bytes held from UNSHARD to RESHARD; per transfer: duration and bytes; per rank: static bytes."""

    durations: list[list[float]]
    allocs: list[list[int]]
    frees: list[list[int]]
    unsharded: list[list[int]]
    transfer_us: list[float]
    transfer_bytes: list[int]
    static_bytes: list[int]
    microbatch_size: int


def bind(program: Program, costs: CostModel) -> Bound:
    """Look every step's cost up once, so the engine never touches the cost model."""
    num_stages = program.num_stages
    if len(costs.stages) != num_stages:
        raise ValueError(
            f"the cost model has {len(costs.stages)} stages but the plan has {num_stages}: give one StageCost per stage"
        )
    table: dict[tuple[int, int], float] = {
        (s, code): costs.duration_us(s, kind) for s in range(num_stages) for code, kind in _KINDS.items()
    }
    saved = [stage.activation_bytes for stage in costs.stages]
    freed_by_input = [stage.freed_by_backward_input_bytes for stage in costs.stages]
    unsharded_bytes = [
        stage.parameter_bytes if stage.unsharded_bytes is None else stage.unsharded_bytes for stage in costs.stages
    ]
    frees_by_kind: dict[int, list[int]] = {
        F: [0] * num_stages,
        I: freed_by_input,
        W: [saved[s] - freed_by_input[s] for s in range(num_stages)],
        B: saved,
    }
    overlap_cache: dict[tuple[int, int, int], float] = {}
    durations, allocs, frees, unsharded = [], [], [], []
    for row in program.labels:
        d_row = [0.0] * len(row)
        a_row = [0] * len(row)
        f_row = [0] * len(row)
        u_row = [0] * len(row)
        for step, label in enumerate(row):
            kind = label[0]
            if kind <= B:
                stage = label[1]
                d_row[step] = table[stage, kind]
                if kind == F:
                    a_row[step] = saved[stage]
                else:
                    f_row[step] = frees_by_kind[kind][stage]
            elif kind == OVERLAP:
                key = (label[1], label[4], label[3])
                if key not in overlap_cache:
                    overlap_cache[key] = costs.overlap_us(label[1], label[4], _KINDS[label[3]])
                d_row[step] = overlap_cache[key]
                a_row[step] = saved[label[1]]
                f_row[step] = frees_by_kind[label[3]][label[4]]
            elif kind in _COLLECTIVES:
                d_row[step] = table[label[1], kind]
                if kind == UNSHARD:
                    u_row[step] = unsharded_bytes[label[1]]
            elif kind == RESHARD:
                u_row[step] = -unsharded_bytes[label[1]]
        durations.append(d_row)
        allocs.append(a_row)
        frees.append(f_row)
        unsharded.append(u_row)
    outputs = [stage.output_bytes for stage in costs.stages]
    transfer_bytes = [outputs[s] for s in program.boundary_stage]
    link_cache: dict[tuple[int, int, int], float] = {}
    transfer_us = []
    for (source, _), (destination, _), size in zip(program.sender, program.receiver, transfer_bytes, strict=True):
        key = (source, destination, size)
        if key not in link_cache:
            link_cache[key] = costs.link(source, destination).transfer_us(size)
        transfer_us.append(link_cache[key])
    static = [0] * program.num_ranks
    for stage, rank in enumerate(program.placement):
        static[rank] += costs.stages[stage].static_bytes
    return Bound(
        durations=durations,
        allocs=allocs,
        frees=frees,
        unsharded=unsharded,
        transfer_us=transfer_us,
        transfer_bytes=transfer_bytes,
        static_bytes=static,
        microbatch_size=costs.microbatch_size,
    )
