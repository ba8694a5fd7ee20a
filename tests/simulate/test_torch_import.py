"""Plans imported from torch.distributed.pipelining CSVs simulate without error.

The CSVs are real: torch's own schedule classes compute their orders (with
stand-in stages: the classes only read indices and sizes, no process group is
formed) and ``_dump_csv`` writes them. Runtime schedules are imported both as
torch lowered them (``compute_comms``: UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV
where torch put them) and as compute-only orders lowered by ``add_p2p_actions``;
the two must simulate to the same step time.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from octopipe.ir import add_p2p_actions, stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import (
    CostModel,
    PlanError,
    StageCost,
    StageSpec,
    build_plan,
    load_plan,
    plan_from_torch_csv,
    rank_actions,
    simulate,
    verify_plan,
)

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
CASES = [
    ("ScheduleGPipe", 1),
    ("ScheduleInterleaved1F1B", 2),
    ("ScheduleLoopedBFS", 2),
    ("ScheduleInterleavedZeroBubble", 1),
    ("ScheduleInterleavedZeroBubble", 2),
    ("ScheduleZBVZeroBubble", 2),
    ("ScheduleDualPipeV", 2),
]
COSTS = StageCost(
    forward_us=3, backward_input_us=4, backward_weight_us=2, activation_bytes=1 << 20, output_bytes=1 << 16
)


class TorchStage:
    """Just what torch's schedule classes read from a stage to compute their order."""

    def __init__(self, index: int, num_stages: int, rank: int, size: int) -> None:
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, size
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def torch_schedule(name: str, p: int, v: int, m: int) -> Any:
    cls = getattr(schedules, name)
    # rank 0 holds stages 0 and 2p-1 in a V, stages 0, p, 2p, ... when interleaved
    indices = [0, 2 * p - 1] if name in V_SHAPED else [c * p for c in range(v)]
    stages = [TorchStage(index, p * v, 0, p) for index in indices]
    if issubclass(cls, schedules.PipelineScheduleMulti):
        return cls(stages, m)
    return cls(stages[0], m)


def write_compute_only(schedule: Any, path: Path) -> None:
    """torch's CSV format: one row per rank, one action per cell, empty cells for idle steps."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        for rank in sorted(schedule.pipeline_order):
            writer.writerow(["" if a is None else str(a) for a in schedule.pipeline_order[rank]])


def lowered(plan: plan_pb2.Plan) -> plan_pb2.Plan:
    placement = stage_ranks(plan)
    return build_plan(
        stages=[StageSpec(rank=placement[s]) for s in range(len(plan.stages))],
        actions=add_p2p_actions(rank_actions(plan), placement),
        num_microbatches=plan.num_microbatches,
    )


@pytest.mark.parametrize(("name", "v"), CASES, ids=[f"{n}-v{v}" for n, v in CASES])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_torch_csv_simulates(name: str, v: int, p: int, m: int, tmp_path: Path) -> None:
    schedule = torch_schedule(name, p, v, m)
    costs = CostModel.uniform(num_stages=p * v, stage=COSTS)
    compute_only = tmp_path / "compute_only.csv"
    write_compute_only(schedule, compute_only)
    ours = lowered(plan_from_torch_csv(compute_only.read_text(), num_microbatches=m))
    verify_plan(ours)
    step = simulate(ours, costs).estimate.step_time_us
    assert step > 0
    if hasattr(schedule, "pipeline_order_with_comms"):
        with_comms = tmp_path / "compute_comms.csv"
        schedule._dump_csv(str(with_comms), format="compute_comms")
        theirs = load_plan(with_comms)
        theirs.num_microbatches = m
        kinds = {a.kind.name for acts in rank_actions(theirs).values() for a in acts}
        assert {"UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F"} <= kinds
        verify_plan(theirs)
        simulation = simulate(theirs, costs)
        assert simulation.estimate.step_time_us == step  # receives posted earlier never change the step here
        assert len(simulation.timeline()) == sum(len(r.actions) for r in theirs.ranks)


def test_torch_1f1b_order_is_rejected_where_it_is_off_by_one(tmp_path: Path) -> None:
    """facts.md: Schedule1F1B._get_pipeline_order is off by one on the last rank. The verifier says where."""
    schedule = torch_schedule("Schedule1F1B", 2, 1, 4)
    path = tmp_path / "1f1b.csv"
    write_compute_only(schedule, path)
    with pytest.raises(PlanError, match=r"stage 1 \(rank 1\) does not run micro-batches 0..3 \(4 given\)") as caught:
        plan_from_torch_csv(path.read_text(), num_microbatches=4)
    assert "forwards of micro-batches [4] beyond 0..3; no forward of micro-batches [0]" in str(caught.value)
    # inferred, the count is one too many for stage 0: said just as clearly, never guessed silently
    with pytest.raises(PlanError, match=r"stage 0 \(rank 0\) does not run micro-batches 0..4 \(5 inferred"):
        plan_from_torch_csv(path.read_text())
