"""The closed loop: re-tune a running plan from its measured timelines and switch at a step boundary.

After the run's first steps the coordinator folds the measured per-action
times into the submitted profile: each stage's forward time is the measured
one, and its backward halves (I and W) are the profile's scaled by measured
backward / profiled backward, so a plan measured with fused backwards can
still be compared with zero-bubble ones. It then re-schedules the same stages
on the same ranks (the schedule library where it fits the layout, and the
list scheduler with the calibrated costs), simulates every candidate and the
running plan with those costs, and switches when the best is predicted at
least ``min_gain`` faster. Ranks take the new plan at their next step
boundary; the measured gain is reported once the run ends.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from octopipe.execute.runtime.measure import local_cost_model
from octopipe.ir import PlanError, StageSpec, add_p2p_actions, build_plan, stage_ranks
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, calibrate_profile, simulate
from octopipe.tune import ListSchedulerConfig, gpipe, list_schedule, one_f_one_b, zb_h1, zb_h2

__all__ = ["Retune", "calibrated_costs", "measured_gain", "retune"]

_LIBRARY: dict[str, Callable[..., plan_pb2.Plan]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


@dataclass(frozen=True)
class Retune:
    """The best plan for the measured costs, and the predicted step times of it and of the running plan."""

    plan: plan_pb2.Plan
    name: str
    current_us: float
    best_us: float

    @property
    def predicted_gain(self) -> float:
        return self.current_us / self.best_us if self.best_us > 0 else 1.0


def calibrated_costs(
    plan: plan_pb2.Plan, profile: profile_pb2.Profile, timelines: Iterable[profile_pb2.RankTimeline]
) -> CostModel:
    """The costs of ``plan`` from ``profile`` calibrated in situ by ``timelines`` (``simulate.calibrate_profile``,
    the same calibration the tuner's profile gets from a calibration run)."""
    return local_cost_model(plan, calibrate_profile(profile, plan, timelines).profile)


def _layout(plan: plan_pb2.Plan) -> list[tuple[tuple[str, ...], int]]:
    return [(tuple(stage.layer_names), stage.rank) for stage in plan.stages]


def _candidates(plan: plan_pb2.Plan, costs: CostModel) -> dict[str, plan_pb2.Plan]:
    ranks, m = len(plan.ranks), plan.num_microbatches
    names = [list(stage.layer_names) for stage in plan.stages]
    found: dict[str, plan_pb2.Plan] = {}
    for name, schedule in _LIBRARY.items():
        try:
            candidate = schedule(ranks, m, layer_names=names)
        except (ValueError, PlanError):
            continue
        if _layout(candidate) == _layout(plan):
            found[name] = candidate
    placement = [stage_ranks(plan)[s] for s in range(len(plan.stages))]
    caps = {p.rank: p.memory_cap_bytes for p in plan.ranks if p.HasField("memory_cap_bytes")}
    for split in (True, False):
        try:
            compute = list_schedule(
                costs, placement, m, memory_caps=caps, config=ListSchedulerConfig(split_backward=split)
            )
        except ValueError:
            continue
        stages = [
            StageSpec(rank=rank, layer_names=tuple(layers)) for rank, layers in zip(placement, names, strict=True)
        ]
        actions = add_p2p_actions(compute, dict(enumerate(placement)))
        found["list" + ("-zb" if split else "")] = build_plan(
            stages=stages, actions=actions, num_microbatches=m, memory_caps=caps, name=f"list-p{ranks}-m{m}"
        )
    return found


def retune(plan: plan_pb2.Plan, profile: profile_pb2.Profile, timelines: Iterable[profile_pb2.RankTimeline]) -> Retune:
    """Re-schedule ``plan``'s stages with costs calibrated by ``timelines``; the best candidate and its gain."""
    costs = calibrated_costs(plan, profile, list(timelines))
    current_us = simulate(plan, costs).estimate.step_time_us
    best_name, best_plan, best_us = "current", plan, current_us
    for name, candidate in _candidates(plan, costs).items():
        try:
            step_us = simulate(candidate, costs).estimate.step_time_us
        except PlanError:  # breaks a memory cap or does not verify: not a candidate
            continue
        if step_us < best_us:
            best_name, best_plan, best_us = name, candidate, step_us
    chosen = plan_pb2.Plan()
    chosen.CopyFrom(best_plan)
    chosen.model.CopyFrom(plan.model)
    if plan.HasField("mesh"):
        chosen.mesh.CopyFrom(plan.mesh)
    chosen.labels["schedule"] = best_name
    return Retune(plan=chosen, name=best_name, current_us=current_us, best_us=best_us)


def measured_gain(metrics: Iterable[node_pb2.StepMetrics]) -> tuple[float, float] | None:
    """Median step time (slowest rank) before and after the first plan switch, skipping the first step of each."""
    steps: dict[tuple[int, int], float] = {}
    for item in metrics:
        key = (item.plan_switches, item.step)
        steps[key] = max(steps.get(key, 0.0), item.step_duration_us)
    before = [t for (switches, step), t in sorted(steps.items()) if switches == 0]
    after = [t for (switches, step), t in sorted(steps.items()) if switches >= 1]
    if len(before) < 2 or len(after) < 2:
        return None
    return statistics.median(before[1:]), statistics.median(after[1:])
