"""Placing FSDP collectives (UNSHARD, RESHARD, REDUCE_GRAD) into a schedule's per-rank programs: one pass, one policy.

A :class:`CollectivePlacement` says where each stage's collectives go in its
rank's program (they run on the rank's collective stream, see
:mod:`octopipe.ir.program`):

* UNSHARD (all-gather of the stage's parameters): with ``prefetch``, every
  stage of the rank is unsharded at the start of the program, in the order of
  first use, so the gathers run under the earlier stages' compute; without it,
  ``ahead`` compute actions before the stage's first computation (0: just
  before it; less memory on ranks with several stages, less overlap);
* REDUCE_GRAD (reduce-scatter of the stage's gradients): just after the
  stage's last computation (its last B or W), so it runs under the rank's later
  compute;
* RESHARD (free the unsharded parameters), with ``reshard``: just after the
  stage's last computation too (before its REDUCE_GRAD); without it the
  parameters stay unsharded until the end of the step.

The tuner, the CLI and the tests all place collectives through this pass; the
result satisfies the program compiler's collective rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octopipe.ir.actions import Action, ActionKind, action_to_proto
from octopipe.ir.plan import rank_actions
from octopipe.plan.v1 import plan_pb2

__all__ = ["PLACEMENTS", "CollectivePlacement", "place_collectives", "with_collectives"]


@dataclass(kw_only=True, frozen=True)
class CollectivePlacement:
    """Where UNSHARD, RESHARD and REDUCE_GRAD go (see the module doc)."""

    prefetch: bool = True
    #: without ``prefetch``: how many compute actions before the stage's first computation its UNSHARD goes
    ahead: int = 0
    reshard: bool = False

    def __post_init__(self) -> None:
        if self.ahead < 0:
            raise ValueError(f"ahead must be >= 0 compute actions, got {self.ahead}")
        if self.prefetch and self.ahead:
            raise ValueError("ahead applies without prefetch (prefetch unshards every stage at the start)")

    @property
    def name(self) -> str:
        if self.prefetch:
            where = "prefetch"
        elif self.ahead:
            where = f"{self.ahead} ahead"
        else:
            where = "just-in-time"
        return where + (", reshard after last use" if self.reshard else "")


# Tried in this order; on equal step time and memory excess the earlier wins, so RESHARD
# is only placed where the memory cap requires it.
PLACEMENTS: tuple[CollectivePlacement, ...] = (
    CollectivePlacement(prefetch=True, reshard=False),
    CollectivePlacement(prefetch=True, reshard=True),
    CollectivePlacement(prefetch=False, reshard=True),
)


def place_collectives(
    actions: Mapping[int, Sequence[Action]],
    placement: Sequence[int] | Mapping[int, int],
    policy: CollectivePlacement,
) -> dict[int, list[Action]]:
    """Each rank's actions with UNSHARD, RESHARD and REDUCE_GRAD of its stages added (existing ones dropped).

    Raises ValueError for a stage with computations but no backward on its
    rank (REDUCE_GRAD would have no place).
    """
    stage_rank = dict(placement) if isinstance(placement, Mapping) else dict(enumerate(placement))
    out: dict[int, list[Action]] = {}
    for rank, program in actions.items():
        kept = [a for a in program if not a.kind.is_collective]
        compute = [index for index, action in enumerate(kept) if action.kind.is_compute]
        first: dict[int, int] = {}  # stage -> position (in ``compute``) of its first computation
        last: dict[int, int] = {}  # stage -> index (in ``kept``) of its last computation
        backward: set[int] = set()
        for position, index in enumerate(compute):
            for part in kept[index].computations:
                first.setdefault(part.stage, position)
                last[part.stage] = index
                if part.kind is not ActionKind.FORWARD:
                    backward.add(part.stage)
        mine = [s for s, r in sorted(stage_rank.items()) if r == rank and s in first]
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        for s in sorted(mine, key=lambda stage: first[stage]):
            if s not in backward:
                raise ValueError(
                    f"rank {rank}: stage {s} has no backward in this program, so REDUCE_GRAD has no place: "
                    "give every stage its B (or I and W)"
                )
            at = 0 if policy.prefetch else compute[max(0, first[s] - policy.ahead)]
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


def with_collectives(plan: plan_pb2.Plan, policy: CollectivePlacement | None = None) -> plan_pb2.Plan:
    """A copy of ``plan`` with every stage's collectives placed by ``policy`` (default: prefetch, no RESHARD).

    Existing UNSHARD, RESHARD and REDUCE_GRAD actions are dropped first, so
    calling this twice gives the same plan.
    """
    placed = place_collectives(
        rank_actions(plan), {s.stage_index: s.rank for s in plan.stages}, policy or CollectivePlacement()
    )
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    for program in out.ranks:
        del program.actions[:]
        program.actions.extend(action_to_proto(a) for a in placed.get(program.rank, []))
    return out
