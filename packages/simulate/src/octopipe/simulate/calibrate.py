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

What the action times do not hold is the runtime's own cost between them:
its dispatch of each action and each message's CPU work
(``octopipe.simulate.runtime_costs``). Those are named terms, measured by their
own micro-bench; calibration may refine a term only within its physical
bounds (``fit_term``), and the link's latency only within the probe's bounds
(``fit_link_latency`` with ``probe_bounds``: a factor of 2 either way), so
the runtime's costs are never passed off as the link's. Each fit reports its
value, its bounds and whether the data pushed it against one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from octopipe.ir.actions import ActionKind
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.costs import CostModel, durations_from_timelines
from octopipe.simulate.links import Link
from octopipe.simulate.runtime_costs import BOUNDS, FittedTerm
from octopipe.simulate.simulator import SimulationConfig, simulate

__all__ = [
    "Calibration",
    "calibrate_profile",
    "fit_link_latency",
    "fit_message_costs",
    "fit_term",
    "probe_bounds",
    "with_link_latency",
    "with_receive_cpu",
]

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


def probe_bounds(probe: Link, *, factor: float = 2.0) -> tuple[float, float]:
    """The latencies a calibration may give a link whose probe measured ``probe``: within ``factor`` of the
    probed latency either way. A message's cost beyond that is the runtime's (``RuntimeCosts``), not the
    link's."""
    if factor < 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    return probe.latency_us / factor, probe.latency_us * factor


def fit_term(
    plan: plan_pb2.Plan,
    costs: CostModel,
    measured_step_us: float,
    *,
    name: str,
    apply: Callable[[CostModel, float], CostModel],
    bounds: tuple[float, float],
    tolerance: float = 1.0,
) -> FittedTerm:
    """The value of one cost term (``apply(costs, value)`` sets it) within ``bounds`` with which ``plan``'s
    simulated step equals ``measured_step_us``.

    The step never gets shorter as the term grows, so a bisection finds it. The fit never leaves the bounds:
    a step that even the low bound over-predicts gives the low bound, one that even the high bound
    under-predicts the high bound, each reported ``clamped`` (the rest of the gap is not this term's).
    """
    if not measured_step_us > 0:
        raise ValueError(f"measured_step_us must be > 0, got {measured_step_us}")
    low, high = bounds
    if not 0 <= low <= high < math.inf:
        raise ValueError(f"{name}: bounds must be finite with 0 <= low <= high, got {bounds}")
    config = SimulationConfig(enforce_memory_caps=False, critical_path=False)

    def step(value: float) -> float:
        return simulate(plan, apply(costs, value), config=config).estimate.step_time_us

    at_low = step(low)
    if at_low >= measured_step_us:  # the data asks for the low bound or less
        return FittedTerm(name, low, bounds[0], bounds[1], clamped=at_low > measured_step_us)
    if step(high) < measured_step_us:
        return FittedTerm(name, high, bounds[0], bounds[1], clamped=True)
    while high - low > tolerance:
        middle = (low + high) / 2
        if step(middle) < measured_step_us:
            low = middle
        else:
            high = middle
    return FittedTerm(name, (low + high) / 2, bounds[0], bounds[1])


def fit_link_latency(
    plan: plan_pb2.Plan,
    costs: CostModel,
    measured_step_us: float,
    *,
    bounds: tuple[float, float],
    tolerance_us: float = 1.0,
) -> FittedTerm:
    """The link latency within ``bounds`` (``probe_bounds(probed link)``) with which ``plan``'s simulated step
    (``costs`` otherwise) equals ``measured_step_us`` (``fit_term``); held at a bound, and reported so, where
    the link cannot explain the step."""
    return fit_term(
        plan,
        costs,
        measured_step_us,
        name="link.latency_us",
        apply=with_link_latency,
        bounds=bounds,
        tolerance=tolerance_us,
    )


def with_receive_cpu(costs: CostModel, fixed_us: float) -> CostModel:
    """``costs`` with the runtime's fixed CPU work per message on the receiving end set to ``fixed_us``."""
    runtime = costs.runtime
    receive = dataclasses.replace(runtime.recv_cpu, fixed_us=fixed_us)
    return dataclasses.replace(costs, runtime=dataclasses.replace(runtime, recv_cpu=receive))


def fit_message_costs(
    plan: plan_pb2.Plan, costs: CostModel, measured_step_us: float, *, probe: Link
) -> tuple[FittedTerm, FittedTerm]:
    """Refine what a message costs so that ``plan``'s simulated step equals ``measured_step_us``, each term within
    its bounds: first the runtime's fixed CPU work per message on the receiving end (a message is delivered
    when the receiving channel thread has taken it; ``BOUNDS["message_fixed_us"]``, from what ``costs``
    already holds up), with the link at its probed latency; only where that term is held at its bound, the
    link's latency within ``probe_bounds(probe)``. Returns (receive CPU, link latency), each with its bounds."""
    probed = with_link_latency(costs, probe.latency_us)
    low, high = BOUNDS["message_fixed_us"]
    receive = fit_term(
        plan,
        probed,
        measured_step_us,
        name="recv_cpu.fixed_us",
        apply=with_receive_cpu,
        bounds=(max(low, costs.runtime.recv_cpu.fixed_us), high),
    )
    latency = FittedTerm("link.latency_us", probe.latency_us, *probe_bounds(probe))
    if receive.clamped and receive.value == receive.high:
        latency = fit_link_latency(
            plan, with_receive_cpu(probed, receive.value), measured_step_us, bounds=probe_bounds(probe)
        )
    return receive, latency
