"""A run's per-step results from its metrics when it was resumed or recovered onto another plan: each step
counts its latest attempt's reports (torch-free, no processes)."""

from __future__ import annotations

from octopipe.execute.control.coordinator.recovery import plan_summary
from octopipe.execute.control.coordinator.results import recovered_step_us, step_results
from octopipe.node.v1 import node_pb2
from octopipe.tune import one_f_one_b


def report(step: int, rank: int, version: int, duration: float, loss: float | None = None) -> node_pb2.StepMetrics:
    metrics = node_pb2.StepMetrics(step=step, rank=rank, plan_version=version, step_duration_us=duration)
    if loss is not None:
        metrics.loss, metrics.has_loss = loss, True
    return metrics


def test_steps_rerun_after_a_recovery_count_the_healed_attempt_and_earlier_steps_keep_their_plan() -> None:
    names = [f"l{i}" for i in range(4)]
    healed = one_f_one_b(1, 2, layer_names=[names])  # the plan after the recovery: one rank
    metrics = []
    for step in range(4):  # attempt 1: two ranks, the loss on rank 1; it died during step 3 (rank 0 only)
        metrics.append(report(step, 0, 1, 100.0 + step))
        if step < 3:
            metrics.append(report(step, 1, 1, 200.0 + step, loss=1.0 + step))
    for step in range(2, 5):  # attempt 2 resumed from the checkpoint of step 2, on one rank
        metrics.append(report(step, 0, 2, 50.0 + step, loss=10.0 + step))
    metrics.append(report(5, 0, 3, 1.0))  # not part of the run's plan version yet: ignored below
    losses, times, steps = step_results(healed, [m for m in metrics if m.plan_version <= 2])
    assert losses == [1.0, 2.0, 12.0, 13.0, 14.0]  # step 2 re-run by attempt 2 counts its loss
    assert times == [200.0, 201.0, 52.0, 53.0, 54.0]  # the slowest rank of the attempt that counts
    assert steps == [0, 1, 2, 3, 4]
    lost = [m for m in metrics if m.plan_version <= 2 and not (m.step == 1 and m.rank == 1)]
    assert step_results(healed, lost)[2] == [0, 2, 3, 4]  # step 1's loss died with its node: left out, named
    assert recovered_step_us(metrics, 2) == 53.0 and recovered_step_us(metrics, 7) == 0.0
    assert plan_summary(healed) == "1f1b: 1 stages (4 layers) on 1 ranks, m=2"


def test_a_step_the_running_attempt_has_not_heard_from_every_rank_waits() -> None:
    plan = one_f_one_b(2, 2, layer_names=[["a"], ["b"]])
    metrics = [report(0, 0, 1, 10.0), report(0, 1, 1, 20.0, loss=3.0), report(1, 1, 1, 30.0, loss=4.0)]
    assert step_results(plan, metrics) == ([3.0], [20.0], [0])
