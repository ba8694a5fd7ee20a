"""Schedule generators: functions that return each rank's actions.

A schedule is data, never control flow: each generator returns a Plan whose
rank programs the one simulator scores and the one runtime interprets.
This is the start of the library (GPipe and 1F1B); the rest follow.
"""

from __future__ import annotations

from collections.abc import Sequence

from octopipe.plan.v1 import plan_pb2
from octopipe.simulate.ir import Action, ActionKind, StageSpec, add_p2p_actions, build_plan

__all__ = ["gpipe", "one_f_one_b"]


def _check(num_ranks: int, num_microbatches: int, layer_names: Sequence[Sequence[str]] | None) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if layer_names is not None and len(layer_names) != num_ranks:
        raise ValueError(
            f"layer_names has {len(layer_names)} stages; these schedules need one stage per rank ({num_ranks})"
        )


def _plan(
    name: str,
    compute: dict[int, list[Action]],
    num_ranks: int,
    num_microbatches: int,
    layer_names: Sequence[Sequence[str]] | None,
) -> plan_pb2.Plan:
    placement = {s: s for s in range(num_ranks)}
    stages = [StageSpec(rank=s, layer_names=tuple(layer_names[s]) if layer_names else ()) for s in range(num_ranks)]
    return build_plan(
        stages=stages,
        actions=add_p2p_actions(compute, placement),
        num_microbatches=num_microbatches,
        name=f"{name}-p{num_ranks}-m{num_microbatches}",
        labels={"schedule": name},
    )


def gpipe(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """GPipe: every forward, then every backward (stage s on rank s)."""
    _check(num_ranks, num_microbatches, layer_names)
    compute = {
        r: [Action(ActionKind.FORWARD, r, mb) for mb in range(num_microbatches)]
        + [Action(ActionKind.FULL_BACKWARD, r, mb) for mb in range(num_microbatches)]
        for r in range(num_ranks)
    }
    return _plan("gpipe", compute, num_ranks, num_microbatches, layer_names)


def one_f_one_b(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    """1F1B: rank r warms up with p-r-1 forwards, then alternates F and B, then drains."""
    _check(num_ranks, num_microbatches, layer_names)
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
    return _plan("1f1b", compute, num_ranks, num_microbatches, layer_names)
