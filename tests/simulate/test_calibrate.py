"""In-situ calibration: layer times scaled so each stage of the calibration plan sums to its measured median."""

from __future__ import annotations

import dataclasses

import pytest

from octopipe.ir import action_to_proto, parse_action
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    BOUNDS,
    CostModel,
    Link,
    MessageCpu,
    RuntimeCosts,
    StageCost,
    calibrate_profile,
    fit_link_latency,
    fit_message_costs,
    fit_term,
    probe_bounds,
    simulate,
    with_link_latency,
)
from octopipe.tune import one_f_one_b, zb_h1


def profile_of(count: int) -> profile_pb2.Profile:
    return profile_pb2.Profile(
        layers=[
            profile_pb2.LayerCost(
                layer_name=f"l{i}",
                forward_duration_us=10.0 * (i + 1),
                backward_input_duration_us=5.0,
                backward_weight_duration_us=4.0,
                full_backward_duration_us=8.0,
            )
            for i in range(count)
        ]
    )


def timeline(rank: int, durations: list[tuple[str, float]]) -> profile_pb2.RankTimeline:
    out, clock = profile_pb2.RankTimeline(rank=rank), 0.0
    for action, duration in durations:
        out.records.add(action=action_to_proto(parse_action(action)), start_us=clock, end_us=clock + duration)
        clock += duration
    return out


def test_split_backward_run_scales_each_kind_per_stage() -> None:
    profile = profile_of(4)
    plan = zb_h1(2, 2, layer_names=[["l0", "l1"], ["l2", "l3"]])
    # stage 0 profiled: F 30, I 10, W 8; stage 1: F 70, I 10, W 8
    runs = [
        timeline(0, [("0F0", 60.0), ("0F1", 60.0), ("0I0", 15.0), ("0W0", 8.0), ("0I1", 15.0), ("0W1", 8.0)]),
        timeline(1, [("1F0", 70.0), ("1I0", 20.0), ("1W0", 4.0), ("1F1", 70.0), ("1I1", 20.0), ("1W1", 4.0)]),
    ]
    calibration = calibrate_profile(profile, plan, runs)
    assert calibration.factors[0] == {"F": 2.0, "I": 1.5, "W": 1.0, "B": pytest.approx(23 / 18)}
    assert calibration.factors[1] == {"F": 1.0, "I": 2.0, "W": 0.5, "B": pytest.approx(24 / 18)}
    layers = {c.layer_name: c for c in calibration.profile.layers}
    assert [layers[n].forward_duration_us for n in ("l0", "l1", "l2", "l3")] == [20.0, 40.0, 30.0, 40.0]
    assert layers["l2"].backward_input_duration_us == 10.0 and layers["l2"].backward_weight_duration_us == 2.0
    assert layers["l0"].full_backward_duration_us == pytest.approx(8.0 * 23 / 18)
    assert profile.layers[0].forward_duration_us == 10.0  # the input profile is not changed
    # another partition: each layer keeps its own factor, so stage sums follow
    other = one_f_one_b(2, 2, layer_names=[["l0"], ["l1", "l2", "l3"]])
    costs = CostModel.from_profile(other, calibration.profile, default_link=Link())
    assert costs.stages[0].forward_us == 20.0 and costs.stages[1].forward_us == 40.0 + 30.0 + 40.0


def test_fused_backward_run_scales_input_and_weight_alike() -> None:
    profile = profile_of(2)
    plan = one_f_one_b(2, 1, layer_names=[["l0"], ["l1"]])
    runs = [timeline(0, [("0F0", 10.0), ("0B0", 16.0)]), timeline(1, [("1F0", 40.0), ("1B0", 4.0)])]
    calibration = calibrate_profile(profile, plan, runs)
    assert calibration.factors[0] == {"F": 1.0, "B": 2.0, "I": 16 / 9, "W": 16 / 9}
    assert calibration.factors[1]["F"] == 2.0 and calibration.factors[1]["B"] == 0.5
    with pytest.raises(ValueError, match="not in the profile"):
        calibrate_profile(profile, one_f_one_b(2, 1, layer_names=[["l0"], ["zz"]]), runs)


def test_fit_link_latency_reproduces_a_measured_step() -> None:
    """The latency with which the simulated step equals the measured one; monotone, so bisection finds it."""
    plan = one_f_one_b(2, 4)
    costs = CostModel.uniform(
        num_stages=2, stage=StageCost(forward_us=10.0, full_backward_us=20.0, output_bytes=0), link=Link()
    )
    free = simulate(plan, costs).estimate.step_time_us
    slow = simulate(plan, with_link_latency(costs, 7.0)).estimate.step_time_us
    assert slow > free
    latency = fit_link_latency(plan, costs, slow, bounds=(0.0, 100.0), tolerance_us=0.01)
    assert latency.value == pytest.approx(7.0, abs=0.02) and not latency.clamped
    assert (latency.low, latency.high) == (0.0, 100.0)
    held = fit_link_latency(plan, costs, free / 2, bounds=(0.0, 100.0))  # faster than free messages
    assert held.value == 0.0 and held.clamped
    with pytest.raises(ValueError, match="> 0"):
        fit_link_latency(plan, costs, 0.0, bounds=(0.0, 100.0))


def test_calibration_never_gives_the_link_a_latency_outside_the_probe_bounds() -> None:
    """A step far longer than any message can explain: the receive-side CPU term and the link latency are each
    held at their bound and say so; the link stays within 2x of the probe."""
    plan = one_f_one_b(2, 4)
    costs = CostModel.uniform(
        num_stages=2, stage=StageCost(forward_us=10.0, full_backward_us=20.0, output_bytes=0), link=Link()
    )
    probe = Link(latency_us=50.0, bandwidth_bytes_per_second=1e9)
    assert probe_bounds(probe) == (25.0, 100.0)
    free = simulate(plan, costs).estimate.step_time_us
    receive, latency = fit_message_costs(plan, costs, free * 1000, probe=probe)
    assert receive.clamped and receive.value == BOUNDS["message_fixed_us"][1]
    assert latency.clamped and latency.value == 100.0 and (latency.low, latency.high) == (25.0, 100.0)
    # a step the probed link plus some CPU per message explains: the CPU term takes it, the link keeps its probe
    truth = dataclasses.replace(
        with_link_latency(costs, 50.0), runtime=RuntimeCosts(recv_cpu=MessageCpu(fixed_us=300.0))
    )
    measured = simulate(plan, truth).estimate.step_time_us
    receive, latency = fit_message_costs(plan, costs, measured, probe=probe)
    assert receive.value == pytest.approx(300.0, abs=1.0) and not receive.clamped
    assert latency.value == 50.0 and not latency.clamped
    with pytest.raises(ValueError, match="bounds must be finite"):
        fit_term(plan, costs, measured, name="x", apply=with_link_latency, bounds=(5.0, 1.0))


def test_a_stage_whose_input_needs_no_gradient_scales_i_and_w_together() -> None:
    """Its I measures ~0 and its W both halves: per-kind factors would be 0 and huge; one shared factor is not."""
    profile = profile_of(2)
    profile.layers[0].input_without_gradient = True
    plan = zb_h1(2, 1, layer_names=[["l0"], ["l1"]])
    runs = [
        timeline(0, [("0F0", 10.0), ("0I0", 0.1), ("0W0", 17.9)]),
        timeline(1, [("1F0", 20.0), ("1I0", 5.0), ("1W0", 4.0)]),
    ]
    factors = calibrate_profile(profile, plan, runs).factors
    assert factors[0]["I"] == factors[0]["W"] == pytest.approx(18.0 / 9.0)
    assert (factors[1]["I"], factors[1]["W"]) == (1.0, 1.0)
