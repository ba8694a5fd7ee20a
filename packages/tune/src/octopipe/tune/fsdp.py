"""Placing FSDP collectives (UNSHARD, RESHARD, REDUCE_GRAD) into a schedule's per-rank programs.

A :class:`CollectivePlacement` says where each stage's collectives go in its
rank's program (which run on the rank's collective stream, see
``octopipe.simulate.engine``):

* UNSHARD (all-gather of the stage's parameters): with ``prefetch``, every
  stage of the rank is unsharded at the start of the program, in the order of
  first use, so the gathers run under the earlier stages' compute; without it,
  just before the stage's first computation (less memory on ranks with
  several stages, less overlap);
* REDUCE_GRAD (reduce-scatter of the stage's gradients): just after the
  stage's last computation, so it runs under the rank's later compute;
* RESHARD (free the unsharded parameters), with ``reshard``: just after the
  stage's last computation too (before its REDUCE_GRAD); without it the
  parameters stay unsharded until the end of the step.

The result satisfies the verifier's collective rules (``octopipe.ir.program``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octopipe.ir import Action, ActionKind

__all__ = ["PLACEMENTS", "CollectivePlacement", "place_collectives"]


@dataclass(kw_only=True, frozen=True)
class CollectivePlacement:
    """Where UNSHARD, RESHARD and REDUCE_GRAD go (see the module doc)."""

    prefetch: bool = True
    reshard: bool = False

    @property
    def name(self) -> str:
        return ("prefetch" if self.prefetch else "just-in-time") + (", reshard after last use" if self.reshard else "")


# Tried in this order; on equal step time and memory excess the earlier wins, so RESHARD
# is only placed where the memory cap requires it.
PLACEMENTS: tuple[CollectivePlacement, ...] = (
    CollectivePlacement(prefetch=True, reshard=False),
    CollectivePlacement(prefetch=True, reshard=True),
    CollectivePlacement(prefetch=False, reshard=True),
)


def place_collectives(
    actions: Mapping[int, Sequence[Action]],
    placement: Sequence[int],
    policy: CollectivePlacement,
) -> dict[int, list[Action]]:
    """Each rank's actions with UNSHARD, RESHARD and REDUCE_GRAD of its stages added (existing ones dropped)."""
    out: dict[int, list[Action]] = {}
    for rank, program in actions.items():
        kept = [a for a in program if not a.kind.is_collective]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, action in enumerate(kept):
            if not action.kind.is_compute:
                continue
            for part in action.computations:
                first.setdefault(part.stage, index)
                last[part.stage] = index
        mine = [s for s, r in enumerate(placement) if r == rank and s in first]
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        for s in sorted(mine, key=lambda stage: first[stage]):
            at = 0 if policy.prefetch else first[s]
            before.setdefault(at, []).append(Action(ActionKind.UNSHARD, s))
            tail = after.setdefault(last[s], [])
            if policy.reshard:
                tail.append(Action(ActionKind.RESHARD, s))
            tail.append(Action(ActionKind.REDUCE_GRAD, s))
        lowered: list[Action] = []
        for index, action in enumerate(kept):
            lowered.extend(before.get(index, ()))
            lowered.append(action)
            lowered.extend(after.get(index, ()))
        out[rank] = lowered
    return out
