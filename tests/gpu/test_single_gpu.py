"""Plans with every stage on one GPU (a world of one: no messages) against the eager reference on the same
GPU: the same ops in the same order, with torch's deterministic kernels on both sides, so fp32 losses,
every gradient and the weights after the optimizer steps are bitwise equal, as on the CPU. Runs where torch
sees a GPU (see conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from octopipe.execute.runs import RunOptions
from octopipe.execute.runtime import build_model, reference_run, run_local, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import Device
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v

STEPS = 2
M = 4


def _plan(workload: str, schedule: Callable[..., plan_pb2.Plan], stages: int) -> plan_pb2.Plan:
    reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = schedule(1, M, layer_names=equal_partition(names, stages))  # every stage on the one rank
    plan.model.CopyFrom(reference)
    return plan


def _assert_bitwise(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.parametrize("workload", ["llama-8", "nemotronh-16"])
@pytest.mark.parametrize(
    ("schedule", "stages"), [(one_f_one_b, 1), (zb_h1, 1), (zb_v, 2)], ids=["1f1b", "zb-h1", "zb-v"]
)
def test_a_one_gpu_plan_equals_eager_cuda_bitwise(
    workload: str, schedule: Callable[..., plan_pb2.Plan], stages: int
) -> None:
    plan = _plan(workload, schedule, stages)
    options = RunOptions(
        steps=STEPS, device="cuda", deterministic=True, keep_grads=True, keep_params=True, pin_cores=False
    )
    run = run_local(plan, options)
    gpu = Device.parse("cuda:0")
    gpu.make_deterministic()  # as every rank does with deterministic=True
    ref = reference_run(plan.model, num_microbatches=M, steps=STEPS, device=gpu)
    assert run.losses == ref.losses
    _assert_bitwise(ref.grads, run.grads)
    _assert_bitwise(ref.params, run.params)


#: bf16 against float32 eager on the same GPU: the stated tolerances (on the CPU these tiny models measured
#: at most 0.8% on a loss and 13% on a gradient's norm, the Mamba blocks' worst; bf16 keeps 8 bits of mantissa)
BF16_LOSS_TOLERANCE = 0.02
BF16_GRAD_TOLERANCE = 0.25


@pytest.mark.parametrize("workload", ["llama-8", "nemotronh-16"])
def test_a_bf16_one_gpu_plan_equals_bf16_eager_cuda_and_stays_near_float32(workload: str) -> None:
    plan = _plan(workload, zb_h1, 1)
    plan.precision.compute_dtype = "bfloat16"  # bf16 weights and activations, float32 masters and gradients
    options = RunOptions(
        steps=STEPS, device="cuda", deterministic=True, keep_grads=True, keep_params=True, pin_cores=False
    )
    run = run_local(plan, options)
    gpu = Device.parse("cuda:0")
    gpu.make_deterministic()
    ref = reference_run(plan.model, num_microbatches=M, steps=STEPS, device=gpu, dtype=torch.bfloat16)
    assert run.losses == ref.losses  # the same bf16 ops in the same order: bitwise, as on the CPU
    _assert_bitwise(ref.grads, run.grads)
    _assert_bitwise(ref.params, run.params)
    full = reference_run(plan.model, num_microbatches=M, steps=STEPS, device=gpu)
    for low, high in zip(run.losses, full.losses, strict=True):
        assert abs(low - high) <= BF16_LOSS_TOLERANCE * abs(high), (low, high)
    for name, grad in full.grads.items():
        scale = float(grad.norm())
        if scale > 0:
            error = float((run.grads[name].float() - grad).norm()) / scale
            assert error <= BF16_GRAD_TOLERANCE, (name, error)
