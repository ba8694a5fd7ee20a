"""Backward merge: an I followed by its W becomes one fused B (as torch's ``_merge_bw`` does).

Running a stage's whole backward at once can be faster than its two halves
(one graph, no context kept between them). Where a rank's program runs
``sIm`` and its next computation is ``sWm`` (same stage, same micro-batch),
the pair becomes ``sBm``; actions between them that are not computations
(a SEND_B of the input gradient, a RECV posted early) keep their order after
the fused backward. Anything else is left as it is; the pass is idempotent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from octopipe.ir.actions import Action, ActionKind

__all__ = ["merge_backward"]


def merge_backward(actions: Mapping[int, Sequence[Action]]) -> dict[int, list[Action]]:
    """Each rank's actions with every I immediately followed (among computations) by its W fused into a B."""
    out: dict[int, list[Action]] = {}
    for rank, program in actions.items():
        merged: list[Action] = []
        skip: set[int] = set()
        for index, action in enumerate(program):
            if index in skip:
                continue
            if action.kind is ActionKind.BACKWARD_INPUT:
                following = next((j for j in range(index + 1, len(program)) if program[j].kind.is_compute), None)
                if following is not None:
                    other = program[following]
                    if other.kind is ActionKind.BACKWARD_WEIGHT and (other.stage, other.microbatch) == (
                        action.stage,
                        action.microbatch,
                    ):
                        merged.append(Action(ActionKind.FULL_BACKWARD, action.stage, action.microbatch))
                        skip.add(following)
                        continue
            merged.append(action)
        out[rank] = merged
    return out
