"""torch.distributed.pipelining's CSV schedules: one row per rank, one action per cell.

``compute_only`` holds F / I / W / B / OVERLAP_F_B; ``compute_comms`` also the
communication and FSDP actions. Empty cells (torch's idle steps) are skipped
on import. CSV carries no partition or model: an import places each stage on
the rank whose row runs it and leaves layer names empty.
"""

from __future__ import annotations

import csv
import io
from typing import Literal

from octopipe.ir.actions import Action, parse_action
from octopipe.ir.plan import PlanError, StageSpec, build_plan, rank_actions
from octopipe.plan.v1 import plan_pb2

__all__ = ["CsvFormat", "plan_from_torch_csv", "plan_to_torch_csv"]

CsvFormat = Literal["compute_only", "compute_comms"]


def plan_to_torch_csv(plan: plan_pb2.Plan, *, format: CsvFormat = "compute_comms") -> str:
    """The plan's per-rank actions as torch CSV text."""
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for _, actions in sorted(rank_actions(plan).items()):
        kept = [a for a in actions if format == "compute_comms" or a.kind.is_compute]
        writer.writerow([str(a) for a in kept])
    return out.getvalue()


def plan_from_torch_csv(
    text: str,
    *,
    num_microbatches: int | None = None,
    name: str = "",
) -> plan_pb2.Plan:
    """A Plan from torch CSV text.

    ``num_microbatches`` defaults to one more than the largest micro-batch used.
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
    used = [p.microbatch for acts in rows.values() for a in acts for p in a.computations if p.microbatch is not None]
    count = num_microbatches if num_microbatches is not None else max(used, default=0) + 1
    stages = [StageSpec(rank=placement[s]) for s in range(max(placement) + 1)]
    return build_plan(stages=stages, actions=rows, num_microbatches=count, name=name)
