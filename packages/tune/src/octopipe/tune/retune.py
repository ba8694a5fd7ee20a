"""Re-tuning a running plan from its measured timelines (the closed loop's decision, torch-free).

After a run's first steps its measured per-action times are folded into the
submitted profile (``simulate.calibrate_profile``: each stage's forward time is
the measured one, and its backward halves (I and W) are the profile's scaled by
measured backward / profiled backward, so a plan measured with fused backwards
can still be compared with zero-bubble ones). :func:`retune` then re-schedules
the same stages on the same ranks — every schedule of the registry whose
placement is the running plan's, and the list scheduler with the calibrated
costs, with and without the I/W split — simulates every candidate and the
running plan with those costs on the local link
(``simulate.local_cost_model``), and returns the fastest, with every
candidate's predicted step (:attr:`Retune.candidates`) and why the others were
left out (:attr:`Retune.skipped`). The coordinator
(``octopipe.execute.control``) switches when the gain is worth it and reports
the measured gain (:func:`measured_gain`) once the run ends.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from octopipe.ir import PlanError, StageSpec, add_p2p_actions, build_plan, stage_ranks
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, calibrate_profile, local_cost_model, local_link, simulate
from octopipe.tune.listsched import ListSchedulerConfig, list_schedule
from octopipe.tune.optimizer import TuneConfig, TuneResult, tune
from octopipe.tune.registry import DEFAULT_SCHEDULES, ScheduleRegistry

__all__ = ["CURRENT", "Retune", "calibrated_costs", "measured_gain", "replan", "retune", "retune_candidates"]

#: the name of the running plan among :attr:`Retune.candidates`
CURRENT = "current"


@dataclass(frozen=True)
class Retune:
    """The best plan for the measured costs, and the predicted step times of it and of the running plan.

    ``candidates``: every plan considered that verified under the calibrated
    costs (the running one as ``"current"``, registry schedules by name, the
    list scheduler as ``"list"`` and ``"list-zb"``) -> its predicted step, us.
    ``skipped``: the registry schedules and list schedules left out -> why.
    """

    plan: plan_pb2.Plan
    name: str
    current_us: float
    best_us: float
    candidates: Mapping[str, float] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def predicted_gain(self) -> float:
        return self.current_us / self.best_us if self.best_us > 0 else 1.0


def calibrated_costs(
    plan: plan_pb2.Plan, profile: profile_pb2.Profile, timelines: Iterable[profile_pb2.RankTimeline]
) -> CostModel:
    """The costs of ``plan`` from ``profile`` calibrated in situ by ``timelines`` (``simulate.calibrate_profile``,
    the same calibration the tuner's profile gets from a calibration run), on the local link."""
    return local_cost_model(plan, calibrate_profile(profile, plan, timelines).profile)


def retune_candidates(
    plan: plan_pb2.Plan, costs: CostModel, *, registry: ScheduleRegistry = DEFAULT_SCHEDULES
) -> tuple[dict[str, plan_pb2.Plan], dict[str, str]]:
    """Plans of ``plan``'s stages on its ranks: each tunable registry entry whose placement is ``plan``'s,
    and the list scheduler on ``costs`` (``"list"``: fused backward, ``"list-zb"``: I/W split); and the
    names left out, with why."""
    ranks, m = len(plan.ranks), plan.num_microbatches
    names = [list(stage.layer_names) for stage in plan.stages]
    ranks_of = stage_ranks(plan)
    placement = tuple(ranks_of[s] for s in range(len(plan.stages)))
    found: dict[str, plan_pb2.Plan] = {}
    skipped: dict[str, str] = {}
    for entry in registry.tunable:
        if entry.placement.stage_ranks(ranks) != placement:
            skipped[entry.name] = f"its {entry.placement.label} placement is not the running plan's"
            continue
        try:
            found[entry.name] = entry.generate(ranks, m, layer_names=names)
        except (ValueError, PlanError) as exc:
            skipped[entry.name] = str(exc)
    caps = {p.rank: p.memory_cap_bytes for p in plan.ranks if p.HasField("memory_cap_bytes")}
    stages = [StageSpec(rank=rank, layer_names=tuple(layers)) for rank, layers in zip(placement, names, strict=True)]
    for split in (True, False):
        name = "list-zb" if split else "list"
        try:
            compute = list_schedule(
                costs, list(placement), m, memory_caps=caps, config=ListSchedulerConfig(split_backward=split)
            )
        except ValueError as exc:
            skipped[name] = str(exc)
            continue
        actions = add_p2p_actions(compute, dict(enumerate(placement)))
        found[name] = build_plan(
            stages=stages, actions=actions, num_microbatches=m, memory_caps=caps, name=f"list-p{ranks}-m{m}"
        )
    return found, skipped


def retune(
    plan: plan_pb2.Plan,
    profile: profile_pb2.Profile,
    timelines: Iterable[profile_pb2.RankTimeline],
    *,
    registry: ScheduleRegistry = DEFAULT_SCHEDULES,
) -> Retune:
    """Re-schedule ``plan``'s stages with costs calibrated by ``timelines``; the best candidate and its gain.

    The running plan stays the choice unless a candidate is predicted strictly
    faster; a candidate that breaks a memory cap or does not verify is skipped.
    """
    costs = calibrated_costs(plan, profile, list(timelines))
    current_us = simulate(plan, costs).estimate.step_time_us
    predicted: dict[str, float] = {CURRENT: current_us}
    built, skipped = retune_candidates(plan, costs, registry=registry)
    best_name, best_plan, best_us = CURRENT, plan, current_us
    for name, candidate in built.items():
        try:
            step_us = simulate(candidate, costs).estimate.step_time_us
        except PlanError as exc:  # breaks a memory cap or does not verify: not a candidate
            skipped[name] = str(exc).splitlines()[0]
            continue
        predicted[name] = step_us
        if step_us < best_us:
            best_name, best_plan, best_us = name, candidate, step_us
    chosen = plan_pb2.Plan()
    chosen.CopyFrom(best_plan)
    chosen.model.CopyFrom(plan.model)
    if plan.HasField("precision"):
        chosen.precision.CopyFrom(plan.precision)
    if plan.HasField("mesh"):
        chosen.mesh.CopyFrom(plan.mesh)
    chosen.labels["schedule"] = best_name
    return Retune(
        plan=chosen, name=best_name, current_us=current_us, best_us=best_us, candidates=predicted, skipped=skipped
    )


def replan(
    plan: plan_pb2.Plan,
    profile: profile_pb2.Profile,
    timelines: Iterable[profile_pb2.RankTimeline],
    num_ranks: int,
    *,
    memory_cap_bytes: int | None = None,
    time_budget_s: float = 20.0,
    min_gain: float = 0.05,
) -> TuneResult:
    """Re-tune partition x placement x schedule of ``plan``'s layers for ``num_ranks`` ranks (a run that lost
    nodes): ``profile`` calibrated by the run's measured ``timelines`` of ``plan`` when there are any, the same
    micro-batch count, the local link, ``memory_cap_bytes`` per rank (None: the tuner's default). A plan more
    complex than 1F1B on equal layers must be predicted faster by more than ``min_gain`` (the simulator's
    error; ``TuneConfig.min_gain``) to be chosen. The returned plan carries ``plan``'s model, precision and a
    ``schedule`` label; raises ValueError when no plan fits."""
    measured = list(timelines)
    calibrated = calibrate_profile(profile, plan, measured).profile if measured else profile
    result = tune(
        calibrated,
        TuneConfig(
            num_ranks=num_ranks,
            num_microbatches=plan.num_microbatches,
            memory_cap_bytes=memory_cap_bytes,
            default_link=local_link(calibrated),
            time_budget_s=time_budget_s,
            min_gain=min_gain,
        ),
    )
    result.plan.model.CopyFrom(plan.model)
    if plan.HasField("precision"):
        result.plan.precision.CopyFrom(plan.precision)
    result.plan.labels["schedule"] = result.plan.labels.get("schedule") or result.plan.name
    return result


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
