"""torch.distributed.pipelining's CSV schedules, both ways: one row per rank, one action per cell.

``compute_only`` holds F / I / W / B / OVERLAP_F_B; ``compute_comms`` also the
communication and FSDP actions. Empty cells (torch's idle steps) are skipped
on import. CSV carries no partition or model: an import places each stage on
the rank whose row runs it and leaves layer names empty.

Import lowers what torch would lower: a CSV without communication gets its
SEND/RECV actions from :func:`~octopipe.ir.lower.add_p2p_actions` (torch's
``_PipelineScheduleRuntime`` adds them when it loads such a file), so it
verifies and runs as it is. The micro-batch count is given or inferred, and
either way every stage must have exactly micro-batches 0..m-1 (torch 2.13's
``Schedule1F1B`` order, off by one on its last rank, is refused here with
where it goes wrong).

Export writes what torch needs to compute the same gradients: torch's runtime
divides the accumulated gradients by the micro-batch count at REDUCE_GRAD
(``scale_grads``), so a ``compute_comms`` export gets a REDUCE_GRAD of each
stage right after its last backward where the plan has none (a plan without
data parallelism); ``compute_only`` leaves that to torch's own lowering.
"""

from __future__ import annotations

import csv
import io
from typing import Literal

from octopipe.ir.actions import Action, ActionKind, parse_action
from octopipe.ir.lower import add_p2p_actions
from octopipe.ir.plan import PlanError, StageSpec, build_plan, rank_actions
from octopipe.ir.recompute import recompute_of
from octopipe.plan.v1 import plan_pb2

__all__ = ["CsvFormat", "plan_from_torch_csv", "plan_to_torch_csv"]

CsvFormat = Literal["compute_only", "compute_comms"]

_BACKWARDS = frozenset({ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})


def _with_reduce_grad(plan: plan_pb2.Plan) -> dict[int, list[Action]]:
    """Each rank's actions, with a REDUCE_GRAD of each stage after its last backward if the plan has none."""
    actions = rank_actions(plan)
    if any(a.kind is ActionKind.REDUCE_GRAD for acts in actions.values() for a in acts):
        return actions
    out: dict[int, list[Action]] = {}
    for rank, program in actions.items():
        last: dict[int, int] = {}
        for index, action in enumerate(program):
            for part in action.computations if action.kind.is_compute else ():
                if part.kind in _BACKWARDS:
                    last[part.stage] = index
        after: dict[int, list[Action]] = {}
        for stage, index in last.items():
            after.setdefault(index, []).append(Action(ActionKind.REDUCE_GRAD, stage))
        out[rank] = [
            x
            for index, action in enumerate(program)
            for x in (action, *sorted(after.get(index, []), key=lambda a: a.stage))
        ]
    return out


def plan_to_torch_csv(plan: plan_pb2.Plan, *, format: CsvFormat = "compute_comms") -> str:
    """The plan's per-rank actions as torch CSV text (``compute_comms`` with REDUCE_GRAD: see the module doc)."""
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
    recomputing = {s.stage_index: recompute_of(s).label for s in plan.stages if recompute_of(s).policy != "none"}
    if recomputing:
        raise PlanError(
            f"stages {sorted(recomputing)} recompute ({', '.join(sorted(set(recomputing.values())))}): torch's CSV "
            "holds action orders only, so the export would drop it; clear Stage.recompute first "
            "(octopipe.ir.with_recompute) or run the plan with octopipe"
        )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    actions = _with_reduce_grad(plan) if format == "compute_comms" else rank_actions(plan)
    for _, program in sorted(actions.items()):
        writer.writerow([str(a) for a in program if format == "compute_comms" or a.kind.is_compute])
    return out.getvalue()


def _microbatches(rows: dict[int, list[Action]], placement: dict[int, int], given: int | None) -> int:
    """The micro-batch count: ``given`` or inferred; every stage must have exactly 0..m-1 (raise PlanError)."""
    forwards: dict[int, set[int]] = {}
    for actions in rows.values():
        for action in actions:
            for part in action.computations:
                if part.kind is ActionKind.FORWARD and part.microbatch is not None:
                    forwards.setdefault(part.stage, set()).add(part.microbatch)
    used = sorted({mb for mbs in forwards.values() for mb in mbs})
    count = given if given is not None else (used[-1] + 1 if used else 0)
    if count < 1:
        raise PlanError("the CSV has no forward actions, so it names no micro-batches: expected e.g. '0F0'")
    expected = set(range(count))
    for stage, mbs in sorted(forwards.items()):
        if mbs != expected:
            extra, missing = sorted(mbs - expected), sorted(expected - mbs)
            detail = "; ".join(
                part
                for part in (
                    f"forwards of micro-batches {extra} beyond 0..{count - 1}" if extra else "",
                    f"no forward of micro-batches {missing}" if missing else "",
                )
                if part
            )
            origin = f"{count} given" if given is not None else f"{count} inferred from the largest index"
            raise PlanError(
                f"stage {stage} (rank {placement[stage]}) does not run micro-batches 0..{count - 1} ({origin}): "
                f"it has {detail}. "
                "Give the micro-batch count the schedule was made for (--microbatches) and check the file"
            )
    return count


def plan_from_torch_csv(
    text: str,
    *,
    num_microbatches: int | None = None,
    name: str = "",
) -> plan_pb2.Plan:
    """A verified-form Plan from torch CSV text; a compute-only CSV gets its communication (see the module doc).

    ``num_microbatches`` defaults to one more than the largest micro-batch used.
    Raises PlanError naming the row and column of an unknown action, or the
    stage whose micro-batches do not match the count.
    """
    rows: dict[int, list[Action]] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        actions: list[Action] = []
        for column, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                actions.append(parse_action(cell))
            except ValueError as exc:
                raise PlanError(f"CSV row {rank + 1} (rank {rank}), column {column + 1}: {exc}") from None
        rows[rank] = actions
    placement: dict[int, int] = {}
    for rank, actions in rows.items():
        for action in actions:
            for part in action.computations:
                previous = placement.setdefault(part.stage, rank)
                if previous != rank:
                    raise PlanError(
                        f"stage {part.stage} has actions on ranks {previous} and {rank}: a stage runs on one rank"
                    )
    if not placement:
        raise PlanError("the CSV has no actions: expected one row of actions per rank")
    missing = sorted(set(range(max(placement) + 1)) - set(placement))
    if missing:
        raise PlanError(f"stages {missing} have no actions: every stage 0..{max(placement)} must appear")
    count = _microbatches(rows, placement, num_microbatches)
    if not any(a.kind.is_p2p for actions in rows.values() for a in actions):
        rows = add_p2p_actions(rows, placement)  # what torch's runtime does when it loads a compute-only file
    stages = [StageSpec(rank=placement[s]) for s in range(max(placement) + 1)]
    return build_plan(stages=stages, actions=rows, num_microbatches=count, name=name)
