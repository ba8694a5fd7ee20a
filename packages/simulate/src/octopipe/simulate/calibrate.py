"""In-situ calibration: a profile whose layer times describe the pipelined run, not layers timed alone.

A layer timed alone on one thread is not the same layer inside a pipeline: the
rank's other stages, the channel threads' copies, caches and the allocator
shared with other micro-batches all change its time. A short calibration run
(a few steps of any plan) measures each action inside the pipeline;
``calibrate_profile`` scales the profile's layer times so that every stage of
that plan sums to its measured median per kind. The scaled profile then serves
any plan and partition (the tuner's, the closed loop's): a layer's factor is
the one of the stage it ran in.

Per stage: F layers by measured F / profiled F; I and W each by their own
factor when the run split the backward (both by measured (I + W) / profiled
(I + W) on a stage whose input needs no gradient: its I does nothing and its W
both halves' work), else both by measured B / profiled (I + W); the fused backward by measured B / profiled fused backward, or when
the run split it, by the I + W factor.

What the action times do not hold is the cost of each message while the
ranks compute: on CPU ranks a message waits for its channel thread to get the
busy core, so a transfer takes far longer than an idle ping-pong says.
``fit_link_latency`` finds the link latency with which the simulator, fed the
calibrated costs, reproduces a measured step: one number per run that other
plans (with more or fewer messages) inherit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from octopipe.ir.actions import ActionKind
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.costs import CostModel, durations_from_timelines
from octopipe.simulate.links import Link
from octopipe.simulate.simulator import SimulationConfig, simulate

__all__ = ["Calibration", "calibrate_profile", "fit_link_latency", "with_link_latency"]

_F, _I, _W, _B = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD


@dataclass(frozen=True)
class Calibration:
    """The calibrated profile and, per stage of the calibration plan, measured / profiled per kind."""

    profile: profile_pb2.Profile
    #: stage -> {"F": factor, "I": ..., "W": ..., "B": ...} (the kinds the run measured or derived)
    factors: dict[int, dict[str, float]] = field(default_factory=dict)


def _ratio(measured: float, profiled: float) -> float:
    return measured / profiled if profiled > 0 else 1.0


def calibrate_profile(
    profile: profile_pb2.Profile, plan: plan_pb2.Plan, timelines: Iterable[profile_pb2.RankTimeline]
) -> Calibration:
    """Scale ``profile``'s layer times to ``plan``'s measured per-action medians in ``timelines`` (see module)."""
    measured = durations_from_timelines(timelines)
    calibrated = profile_pb2.Profile()
    calibrated.CopyFrom(profile)
    layers = {layer.layer_name: layer for layer in calibrated.layers}
    factors: dict[int, dict[str, float]] = {}
    for index, stage in enumerate(plan.stages):
        missing = [name for name in stage.layer_names if name not in layers]
        if missing:
            raise ValueError(f"stage {index}: layers {missing} are not in the profile: calibrate with its own profile")
        mine = [layers[name] for name in stage.layer_names]
        forward = sum(c.forward_duration_us for c in mine)
        backward_input = sum(c.backward_input_duration_us for c in mine)
        backward_weight = sum(c.backward_weight_duration_us for c in mine)
        fused = sum(
            c.full_backward_duration_us
            if c.HasField("full_backward_duration_us")
            else c.backward_input_duration_us + c.backward_weight_duration_us
            for c in mine
        )
        factor: dict[str, float] = {}
        if (index, _F) in measured:
            factor["F"] = _ratio(measured[index, _F], forward)
        if (index, _I) in measured and (index, _W) in measured:
            both = _ratio(measured[index, _I] + measured[index, _W], backward_input + backward_weight)
            if mine[0].input_without_gradient:  # I computes nothing there: W did both halves' work
                factor["I"] = factor["W"] = both
            else:
                factor["I"] = _ratio(measured[index, _I], backward_input)
                factor["W"] = _ratio(measured[index, _W], backward_weight)
            factor["B"] = both
        if (index, _B) in measured:
            factor["B"] = _ratio(measured[index, _B], fused)
            if "I" not in factor:
                factor["I"] = factor["W"] = _ratio(measured[index, _B], backward_input + backward_weight)
        for cost in mine:
            cost.forward_duration_us *= factor.get("F", 1.0)
            cost.backward_input_duration_us *= factor.get("I", 1.0)
            cost.backward_weight_duration_us *= factor.get("W", 1.0)
            if cost.HasField("full_backward_duration_us"):
                cost.full_backward_duration_us *= factor.get("B", 1.0)
        factors[index] = factor
    return Calibration(profile=calibrated, factors=factors)


def with_link_latency(costs: CostModel, latency_us: float) -> CostModel:
    """``costs`` with every link's latency set to ``latency_us`` (bandwidths kept)."""

    def moved(link: Link) -> Link:
        return dataclasses.replace(link, latency_us=latency_us)

    return dataclasses.replace(
        costs,
        links={pair: moved(link) for pair, link in costs.links.items()},
        default_link=None if costs.default_link is None else moved(costs.default_link),
    )


def fit_link_latency(
    plan: plan_pb2.Plan, costs: CostModel, measured_step_us: float, *, tolerance_us: float = 1.0
) -> float:
    """The link latency with which ``plan``'s simulated step (``costs`` otherwise) equals ``measured_step_us``.

    The step never gets shorter as the latency grows, so a bisection finds it;
    0 when even free messages give a longer step than measured.
    """
    if not measured_step_us > 0:
        raise ValueError(f"measured_step_us must be > 0, got {measured_step_us}")
    config = SimulationConfig(enforce_memory_caps=False)

    def step(latency: float) -> float:
        return simulate(plan, with_link_latency(costs, latency), config=config).estimate.step_time_us

    if step(0.0) >= measured_step_us:
        return 0.0
    low, high = 0.0, 100.0
    while step(high) < measured_step_us:
        low, high = high, high * 4
        if high > measured_step_us:  # one message can never take longer than the whole step
            return high
    while high - low > tolerance_us:
        middle = (low + high) / 2
        if step(middle) < measured_step_us:
            low = middle
        else:
            high = middle
    return (low + high) / 2
