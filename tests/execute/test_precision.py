"""Mixed precision as a plan names it (``Plan.precision``): bf16 parameters and activations, float32 master
weights, optimizer state and gradient accumulation. The pipeline runs the same ops in the same order as the
eager reference under the same policy, so losses, every gradient and the weights after the optimizer steps
are bitwise equal to it, as in float32; the profiler sizes what the runtime holds; the policy survives the
plan formats and the tuner; what is not built yet is refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from octopipe.execute.runs import RunOptions, precision_problem
from octopipe.execute.runtime import build_model, reference_run, run_local, workload_reference
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.execute.runtime.precision import in_precision
from octopipe.ir import PlanError, plan_from_text, plan_to_text, validate_plan, with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import TuneConfig, equal_partition, one_f_one_b, tune, zb_v
from tests.execute.test_whole_model_runtime import reference as hf_reference

M = 4


def _plan(workload: str, schedule: Callable[..., plan_pb2.Plan], ranks: int = 2) -> plan_pb2.Plan:
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    stages = 2 * ranks if schedule is zb_v else ranks
    plan = schedule(ranks, M, layer_names=equal_partition(names, stages))
    plan.model.CopyFrom(reference)
    plan.precision.compute_dtype = "bfloat16"
    return plan


# nemotronh-16 (Mamba, MoE, attention) is extended: CI runs it, --quick leaves it out
@pytest.mark.parametrize("workload", ["llama-8", pytest.param("nemotronh-16", marks=pytest.mark.extended)])
@pytest.mark.parametrize("schedule", [one_f_one_b, zb_v], ids=["1f1b", "zb-v"])
def test_a_bf16_pipeline_equals_the_bf16_eager_reference_bitwise(
    workload: str, schedule: Callable[..., plan_pb2.Plan]
) -> None:
    plan = _plan(workload, schedule)
    run = run_local(plan, RunOptions(steps=2, keep_grads=True, keep_params=True, pin_cores=False))
    ref = reference_run(plan.model, num_microbatches=M, steps=2, dtype=torch.bfloat16)
    assert run.losses == ref.losses
    assert sorted(run.grads) == sorted(ref.grads) and sorted(run.params) == sorted(ref.params)
    for name, grad in ref.grads.items():
        assert grad.dtype == torch.float32 and torch.equal(grad, run.grads[name]), name  # accumulated in float32
    for name, weight in ref.params.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, run.params[name]), name  # the masters
    fp32 = reference_run(plan.model, num_microbatches=M, steps=2)
    assert fp32.losses != ref.losses  # the policy was applied: bf16 computes other numbers than float32


def test_the_profiler_sizes_bf16_weights_with_their_float32_masters_and_the_tuner_keeps_the_policy() -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2 * M)
    fp32 = profile_reference(reference, num_microbatches=M, repeats=1)
    bf16 = profile_reference(reference, num_microbatches=M, repeats=1, precision="bfloat16")
    assert not fp32.HasField("precision") and bf16.precision.compute_dtype == "bfloat16"
    for full, half in zip(fp32.layers, bf16.layers, strict=True):
        assert half.parameter_bytes * 2 == full.parameter_bytes  # bf16 weights: 2 bytes each
        assert half.gradient_bytes == full.gradient_bytes  # gradients accumulate in float32 either way
        # AdamW's two float32 moments and, for bf16 weights, the float32 master copy
        assert full.optimizer_state_bytes == 2 * full.parameter_bytes
        assert half.optimizer_state_bytes == 3 * full.parameter_bytes
        assert half.activation_saved_bytes <= full.activation_saved_bytes  # the embedding saves token ids
    assert sum(c.activation_saved_bytes for c in bf16.layers) < sum(c.activation_saved_bytes for c in fp32.layers)
    plan = tune(bf16, TuneConfig(num_ranks=2, num_microbatches=M, time_budget_s=5, max_evaluations=50)).plan
    assert plan.precision.compute_dtype == "bfloat16"  # plans run in the dtypes their costs were measured in


def test_the_policy_survives_the_text_format_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    plan = _plan("llama-8", one_f_one_b)
    text = plan_to_text(plan)
    assert 'precision "bfloat16"' in text.splitlines()
    assert plan_from_text(text) == plan
    plan.precision.compute_dtype = "float16"
    with pytest.raises(PlanError, match=r"precision\.compute_dtype 'float16' is not one of float32, bfloat16"):
        validate_plan(plan)


@pytest.mark.slow
def test_bf16_with_data_parallelism_reduces_gradients_in_float32_and_equals_the_bf16_reference() -> None:
    """FSDP over bf16 weights (pp=1 x dp=2): bf16 shards are gathered, each replica's gradients accumulate in
    float32 and are reduce-scattered in float32 (the interpreter refuses anything else), float32 master shards
    are stepped. Equal to the bf16 reference up to the float32 summation order of the reduction (as float32
    meshes are): a bf16 reduction would be ~1e-3 off, not ~1e-8."""
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(1, M // 2, layer_names=equal_partition(names, 1))
    plan.model.CopyFrom(reference)
    plan.precision.compute_dtype = "bfloat16"
    plan.mesh.dp = 2
    plan = with_collectives(plan)
    assert precision_problem(plan) == ""
    run = run_local(plan, RunOptions(steps=2, keep_grads=True, keep_params=True, pin_cores=False))
    ref = reference_run(plan.model, num_microbatches=M, steps=2, dtype=torch.bfloat16)
    # the reported loss is a bf16 mean, grouped otherwise (each replica's 2 micro-batches, then the replicas):
    # one bf16 rounding step (2^-7 relative at most) apart; the gradients below are the computation's check
    assert run.losses == pytest.approx(ref.losses, rel=2**-7)
    assert sorted(run.grads) == sorted(ref.grads) and sorted(run.params) == sorted(ref.params)
    for what, expected, got in (("grad", ref.grads, run.grads), ("master", ref.params, run.params)):
        for name, value in expected.items():
            assert got[name].dtype == value.dtype == torch.float32, (what, name)
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=f"{what} {name}")


def test_bf16_for_a_model_captured_as_written_is_refused_not_run_differently() -> None:
    built = build_model(hf_reference("llama"))  # what every rank builds; each casts it with in_precision
    assert built.input_names is not None  # captured as written
    with pytest.raises(ValueError, match="not supported yet for a model captured as written"):
        in_precision(built, torch.bfloat16)
