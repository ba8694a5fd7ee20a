"""UNSHARD, REDUCE_GRAD and RESHARD in a Plan's programs: place them, and check a plan that has them.

A stage whose parameters are sharded over its data-parallel group (a plan with
``mesh.dp > 1``) computes only between an UNSHARD (the all-gather) and a
RESHARD or the end of the step, and turns its accumulated full gradients into
shard gradients with exactly one REDUCE_GRAD, after its last backward. The
runtime *refuses* a plan that breaks this (it never gathers or reduces
implicitly): a collective is a synchronisation point every replica must reach
at the same place of its program, so its place belongs in the plan, where the
simulator can see and time it.

:func:`add_fsdp_actions` places the three for a schedule that lacks them:
UNSHARD of each stage ``prefetch`` compute actions before the stage's first
compute action of the step (so the next stage's parameters are gathered while
the rank still works on the current one, where collectives are asynchronous),
REDUCE_GRAD right after the stage's last backward (B or W), and, with
``reshard=True``, RESHARD right after that to free the gathered parameters until
the next step. :func:`check_sharded_programs` is the static check the launcher
runs before any process starts. Neither imports torch.
"""

from __future__ import annotations

from octopipe.ir import Action, ActionKind, action_to_proto, rank_actions, stage_ranks
from octopipe.plan.v1 import plan_pb2

__all__ = ["add_fsdp_actions", "check_sharded_programs"]

_BACKWARDS = frozenset({ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD})


def _stages_of(action: Action, kinds: frozenset[ActionKind] | None = None) -> list[int]:
    return [part.stage for part in action.computations if kinds is None or part.kind in kinds]


def add_fsdp_actions(plan: plan_pb2.Plan, *, prefetch: int = 1, reshard: bool = True) -> plan_pb2.Plan:
    """A copy of ``plan`` with UNSHARD / REDUCE_GRAD (/ RESHARD) placed for every stage (see the module docstring).

    Existing UNSHARD, RESHARD and REDUCE_GRAD actions are dropped first, so
    calling this twice gives the same plan.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 compute actions, got {prefetch}")
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    for program, actions in zip(out.ranks, rank_actions(plan).values(), strict=True):
        plain = [a for a in actions if not a.kind.is_collective]
        compute = [i for i, a in enumerate(plain) if a.kind.is_compute]
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        seen: set[int] = set()
        for position, index in enumerate(compute):
            for stage in _stages_of(plain[index]):
                if stage not in seen:
                    seen.add(stage)
                    at = compute[max(0, position - prefetch)]
                    before.setdefault(at, []).append(Action(ActionKind.UNSHARD, stage))
        last_backward: dict[int, int] = {}
        for index in compute:
            for stage in _stages_of(plain[index], _BACKWARDS):
                last_backward[stage] = index
        for stage in sorted(seen):
            if stage not in last_backward:
                raise ValueError(
                    f"rank {program.rank}: stage {stage} has no backward in this program, so it has no place for "
                    "REDUCE_GRAD: give every stage its B (or I and W)"
                )
            tail = [Action(ActionKind.REDUCE_GRAD, stage)]
            if reshard:
                tail.append(Action(ActionKind.RESHARD, stage))
            after.setdefault(last_backward[stage], []).extend(tail)
        placed = [
            x for index, action in enumerate(plain) for x in (*before.get(index, []), action, *after.get(index, []))
        ]
        del program.actions[:]
        program.actions.extend(action_to_proto(a) for a in placed)
    return out


def check_sharded_programs(plan: plan_pb2.Plan) -> None:
    """Raise ValueError naming the rank, position and action to add or move if a sharded stage's program is wrong.

    For every stage on every rank: each compute action runs after an UNSHARD
    (and no RESHARD since), no backward runs after its REDUCE_GRAD, and there
    is exactly one REDUCE_GRAD per step, after at least one backward.
    """
    placement = stage_ranks(plan)
    for rank, actions in rank_actions(plan).items():
        mine = sorted(s for s, r in placement.items() if r == rank)
        gathered: set[int] = set()
        reduced: set[int] = set()
        backed: set[int] = set()
        for position, action in enumerate(actions):
            where = f"rank {rank}, action {position} ({action})"
            kind, stage = action.kind, action.stage
            if kind is ActionKind.UNSHARD:
                if stage in gathered:
                    raise ValueError(f"{where}: stage {stage} is gathered already; remove this UNSHARD")
                gathered.add(stage)
            elif kind is ActionKind.RESHARD:
                gathered.discard(stage)
            elif kind is ActionKind.REDUCE_GRAD:
                if stage in reduced:
                    raise ValueError(f"{where}: a second REDUCE_GRAD of stage {stage} in one step; keep one")
                if stage not in backed:
                    raise ValueError(
                        f"{where}: REDUCE_GRAD before any backward of stage {stage}; move it after the last W (or B)"
                    )
                reduced.add(stage)
            elif kind.is_compute:
                for part in action.computations:
                    if part.stage not in gathered:
                        raise ValueError(
                            f"{where}: stage {part.stage} is sharded (mesh.dp > 1) and not gathered here; put "
                            f"'{part.stage}UNSHARD' before this action (every step), e.g. with add_fsdp_actions(plan)"
                        )
                    if part.kind in _BACKWARDS:
                        if part.stage in reduced:
                            raise ValueError(
                                f"{where}: a backward of stage {part.stage} after its REDUCE_GRAD; move "
                                f"'{part.stage}REDUCE_GRAD' after the stage's last W (or B)"
                            )
                        backed.add(part.stage)
        missing = [s for s in mine if s not in reduced]
        if missing:
            raise ValueError(
                f"rank {rank}: stages {missing} are sharded (mesh.dp > 1) but never run REDUCE_GRAD; put "
                "'<stage>REDUCE_GRAD' after each one's last W (or B), e.g. with add_fsdp_actions(plan)"
            )
