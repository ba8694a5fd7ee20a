"""A run's results from its step metrics: the loss and the step time of every step, as ``octopipe runs RUN``
shows them and ``GetRun`` returns them; and the step time the simulator predicts for the run's plan."""

from __future__ import annotations

from collections.abc import Iterable

from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate

__all__ = ["predicted_step_us", "step_results"]


def predicted_step_us(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> float:
    """The simulator's step time for ``plan`` with ``profile``'s layer costs and links (the local gloo link
    where the profile measured none); 0 when the profile has no layers. The caller checked that it covers
    the plan's layers (``submission.profile_problem``)."""
    if not profile.layers:
        return 0.0
    return simulate(plan, local_cost_model(plan, profile)).estimate.step_time_us


def step_results(plan: plan_pb2.Plan, metrics: Iterable[node_pb2.StepMetrics]) -> tuple[list[float], list[float]]:
    """(losses, step times in us) per step every rank reported, in step order.

    The loss is the last stage's, summed over the data-parallel replicas in replica order and divided by
    their number (as the local launcher reports it); the step time is the slowest rank's. A step run
    again after a resume counts its latest report.
    """
    mesh = mesh_spec(plan)
    last = plan.stages[-1].rank
    loss_ranks = [mesh.global_rank(last, d) for d in range(mesh.dp)]
    by_step: dict[int, dict[int, node_pb2.StepMetrics]] = {}
    for item in metrics:
        by_step.setdefault(item.step, {})[item.rank] = item
    losses, times = [], []
    for step in sorted(by_step):
        reports = by_step[step]
        if len(reports) < mesh.world_size or any(r not in reports for r in loss_ranks):
            continue  # a step not every rank has reported yet
        values = [reports[r].loss for r in loss_ranks]
        losses.append(sum(values) / mesh.dp if mesh.dp > 1 else values[0])
        times.append(max(r.step_duration_us for r in reports.values()))
    return losses, times
