"""torch.distributed.pipelining both ways, numerically, on 2 gloo ranks.

(a) torch's schedule classes write their orders as CSV; octopipe imports them
    (communication added on import), runs them, and every gradient equals the
    eager reference bitwise. (torch 2.13's ``Schedule1F1B`` writes an order that
    is off by one on its last rank: refused with where, tests/simulate/test_torch_import.py.)
(b) octopipe's plans, exported, run under torch's ``_PipelineScheduleRuntime``:
    the ``compute_comms`` export (octopipe's communication order, REDUCE_GRAD
    added) gives gradients bitwise equal to torch lowering the same compute
    order itself (``compute_only``) and to octopipe's own run. Without the
    REDUCE_GRAD the export would give gradients m times too large.

Micro-batch counts are powers of two: octopipe scales each micro-batch's loss
gradient by 1/m before the backward, torch divides the summed gradients by m
after it; by a power of two both are exact, so the results are bitwise equal.
"""

from __future__ import annotations

import csv
import io

import pytest
import torch

from octopipe.execute.runtime import (
    RunOptions,
    RunResult,
    build_model,
    reference_run,
    run_local_many,
    workload_reference,
)
from octopipe.execute.runtime.interop import _StandIn, torch_placement
from octopipe.ir import ActionKind, plan_from_torch_csv, plan_to_torch_csv, rank_actions, stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import (
    dualpipe_v,
    equal_partition,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    v_half,
    v_min,
    zb_h1,
    zb_h2,
    zb_v,
)
from tests.execute.test_runtime import assert_bitwise, tuned
from tests.execute.torch_pipelining import torch_gradients

pytestmark = pytest.mark.slow

RANKS, M = 2, 4
WORKLOAD = "llama-8"


def torch_csv(name: str) -> str:
    """What torch's schedule class ``name`` writes for RANKS ranks and M micro-batches (its ``_dump_csv`` format)."""
    from torch.distributed.pipelining import schedules

    placement = torch_placement(name, RANKS)
    mine = [_StandIn(s, len(placement), 0, RANKS) for s in sorted(s for s, r in placement.items() if r == 0)]
    cls = getattr(schedules, name)
    schedule = cls(mine, M) if issubclass(cls, schedules.PipelineScheduleMulti) else cls(mine[0], M)
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(schedule.pipeline_order):
        writer.writerow(["" if a is None else str(a) for a in schedule.pipeline_order[rank]])
    return out.getvalue()


def with_model(plan: plan_pb2.Plan) -> plan_pb2.Plan:
    """The imported plan with the workload's layers (equal counts per stage) and model reference."""
    reference = workload_reference(WORKLOAD, tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    for stage, layers in zip(plan.stages, equal_partition(names, len(plan.stages)), strict=True):
        stage.layer_names.extend(layers)
    plan.model.CopyFrom(reference)
    return plan


TORCH_CLASSES = [
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
]


def test_torch_orders_import_and_run_bitwise_equal_to_the_reference() -> None:
    plans = [with_model(plan_from_torch_csv(torch_csv(n), num_microbatches=M, name=n)) for n in TORCH_CLASSES]
    for name, plan in zip(TORCH_CLASSES, plans, strict=True):
        assert stage_ranks(plan) == torch_placement(name, RANKS)
    runs = run_local_many(plans, RunOptions(steps=1, keep_grads=True, timeout_s=120, pin_cores=False))
    reference = reference_run(plans[0].model, num_microbatches=M, steps=1)
    for name, run in zip(TORCH_CLASSES, runs, strict=True):
        assert run.losses == reference.losses, name
        assert_bitwise(reference.grads, run.grads)


def library() -> list[plan_pb2.Plan]:
    reference = workload_reference(WORKLOAD, tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    per_rank, per_chunk = equal_partition(names, RANKS), equal_partition(names, 2 * RANKS)
    plans = [
        gpipe(RANKS, M, layer_names=per_rank),
        one_f_one_b(RANKS, M, layer_names=per_rank),
        zb_h1(RANKS, M, layer_names=per_rank),
        interleaved_1f1b(RANKS, 2, M, layer_names=per_chunk),
        zb_h2(RANKS, M, layer_names=per_rank),
        zb_v(RANKS, M, layer_names=per_chunk),
        v_half(RANKS, M, layer_names=per_chunk),
        v_min(RANKS, M, layer_names=per_chunk),
        dualpipe_v(RANKS, M, layer_names=per_chunk),
        tuned(names, RANKS, M),
    ]
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


PLANS = library()


@pytest.fixture(scope="module")
def ours() -> list[RunResult]:
    """octopipe's own run of every plan (one launch)."""
    return run_local_many(PLANS, RunOptions(steps=1, keep_grads=True, timeout_s=120, pin_cores=False))


@pytest.mark.parametrize("index", range(len(PLANS)), ids=[p.name.split("-p")[0] for p in PLANS])
def test_octopipe_plans_run_under_torch_with_the_same_gradients(index: int, ours: list[RunResult]) -> None:
    plan = PLANS[index]
    exported = plan_to_torch_csv(plan, format="compute_comms")
    assert exported.count("REDUCE_GRAD") == len(plan.stages)
    theirs, own_lowering = torch_gradients(
        plan, [(exported, "compute_comms"), (plan_to_torch_csv(plan, format="compute_only"), "compute_only")]
    )
    assert_bitwise(own_lowering, theirs)
    assert_bitwise(ours[index].grads, theirs)


def test_an_export_without_reduce_grad_would_scale_gradients_m_times() -> None:
    """Why the export adds REDUCE_GRAD: it is where torch's runtime divides by the micro-batch count."""
    plan = PLANS[1]  # 1F1B
    assert all(a.kind is not ActionKind.REDUCE_GRAD for acts in rank_actions(plan).values() for a in acts)
    exported = plan_to_torch_csv(plan, format="compute_comms")
    stripped = "\n".join(",".join(c for c in row.split(",") if "REDUCE_GRAD" not in c) for row in exported.splitlines())
    scaled, unscaled = torch_gradients(plan, [(exported, "compute_comms"), (stripped + "\n", "compute_comms")])
    for name, grad in scaled.items():
        assert torch.equal(unscaled[name], grad * M), name
