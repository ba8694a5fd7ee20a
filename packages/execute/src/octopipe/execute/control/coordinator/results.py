"""A run's results from its step metrics: the loss and the step time of every step, as ``octopipe runs RUN``
shows them and ``GetRun`` returns them; and the step time the simulator predicts for the run's plan."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate

__all__ = ["predicted_step_us", "recovered_step_us", "step_results"]


def predicted_step_us(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> float:
    """The simulator's step time for ``plan`` with ``profile``'s layer costs and links (the local gloo link
    where the profile measured none); 0 when the profile has no layers. The caller checked that it covers
    the plan's layers (``submission.profile_problem``)."""
    if not profile.layers:
        return 0.0
    return simulate(plan, local_cost_model(plan, profile)).estimate.step_time_us


def step_results(
    plan: plan_pb2.Plan, metrics: Iterable[node_pb2.StepMetrics]
) -> tuple[list[float], list[float], list[int]]:
    """(losses, step times in us, the steps they are of) per step every rank reported, in step order.

    The loss is the mean of the losses the step's reports carry (the last stage's, one per data-parallel
    replica, in replica order, as the local launcher reports it); the step time is the slowest rank's. A step
    run again after a resume or a recovery counts its latest attempt's reports (the highest ``plan_version``),
    so steps before a recovery keep the plan that ran them. A step of ``plan``'s attempt counts once every
    one of its ranks reported.
    """
    mesh = mesh_spec(plan)
    by_step: dict[int, dict[int, dict[int, node_pb2.StepMetrics]]] = {}
    for item in metrics:
        by_step.setdefault(item.step, {}).setdefault(item.plan_version, {})[item.rank] = item
    current = max((v for attempts in by_step.values() for v in attempts), default=0)
    losses, times, steps = [], [], []
    for step in sorted(by_step):
        version = max(by_step[step])
        reports = by_step[step][version]
        if version == current and len(reports) < mesh.world_size:
            continue  # a step not every rank of the running attempt has reported yet
        values = [reports[r].loss for r in sorted(reports) if reports[r].has_loss]
        if not values:
            continue
        losses.append(sum(values) / len(values))
        times.append(max(r.step_duration_us for r in reports.values()))
        steps.append(step)
    return losses, times, steps


def recovered_step_us(metrics: Iterable[node_pb2.StepMetrics], version: int) -> float:
    """The median step time (the slowest rank's, us) of the steps attempt ``version`` ran; 0 when none."""
    by_step: dict[int, float] = {}
    for item in metrics:
        if item.plan_version == version:
            by_step[item.step] = max(by_step.get(item.step, 0.0), item.step_duration_us)
    return statistics.median(by_step.values()) if by_step else 0.0
