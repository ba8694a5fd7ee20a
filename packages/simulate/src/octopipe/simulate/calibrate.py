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
factor when the run split the backward, else both by measured B / profiled
(I + W); the fused backward by measured B / profiled fused backward, or when
the run split it, by the I + W factor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from octopipe.ir.actions import ActionKind
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.costs import durations_from_timelines

__all__ = ["Calibration", "calibrate_profile"]

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
            factor["I"] = _ratio(measured[index, _I], backward_input)
            factor["W"] = _ratio(measured[index, _W], backward_weight)
            factor["B"] = _ratio(measured[index, _I] + measured[index, _W], backward_input + backward_weight)
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
