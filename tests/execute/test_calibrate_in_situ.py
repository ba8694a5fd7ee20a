"""In-situ calibration recovers the costs a pipelined run really had (issue 15).

The "run" here is the simulator's own timeline of the plan under known true costs (every action twice
its profiled time, messages 400 us: the probed link's 50 us and 350 us of the runtime's CPU work on the
receiving end): a RunResult holding it must calibrate back to exactly those costs, the link keeping its
probed latency.
"""

from __future__ import annotations

import dataclasses

import pytest

from octopipe.execute.runtime import ActionRecord, RunResult, StepTimeline
from octopipe.execute.runtime.pipeline import calibrate_in_situ
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import MessageCpu, RuntimeCosts, local_cost_model, simulate
from octopipe.tune import one_f_one_b, zb_h1

NAMES = [["l0", "l1"], ["l2", "l3"]]


def profile(scale: float, latency_us: float, receive_cpu_us: float = 0.0) -> profile_pb2.Profile:
    layers = [
        profile_pb2.LayerCost(
            layer_name=f"l{i}",
            forward_duration_us=100.0 * scale * (i + 1),
            backward_input_duration_us=80.0 * scale,
            backward_weight_duration_us=60.0 * scale,
            full_backward_duration_us=130.0 * scale,
            output_tensors=[profile_pb2.TensorSpec(shape=[4], dtype="float32", size_bytes=16)],
        )
        for i in range(4)
    ]
    links = [
        profile_pb2.LinkCost(source_rank=a, destination_rank=b, latency_us=latency_us, bandwidth_bytes_per_second=1e9)
        for a, b in ((0, 1), (1, 0))
    ]
    found = profile_pb2.Profile(layers=layers, links=links)
    if receive_cpu_us:
        found.runtime.CopyFrom(RuntimeCosts(recv_cpu=MessageCpu(fixed_us=receive_cpu_us)).to_proto())
    return found


def as_run(plan: plan_pb2.Plan, truth: profile_pb2.Profile, steps: int = 2) -> RunResult:
    """A RunResult whose every step is the simulated timeline of ``plan`` under ``truth``."""
    simulation = simulate(plan, local_cost_model(plan, truth))
    run = RunResult(losses=[0.0] * steps)
    for rank in range(len(plan.ranks)):
        step_ns = int(simulation.estimate.step_time_us * 1e3)
        end_ns = int(max(t.end_us for t in simulation.timeline(rank)) * 1e3)
        run.timelines[rank] = [
            StepTimeline(
                rank=rank,
                step=s,
                start_ns=s * 10 * step_ns,
                end_ns=end_ns + s * 10 * step_ns,
                records=tuple(
                    ActionRecord(
                        action=t.action,
                        stream=t.stream,
                        start_ns=int(t.start_us * 1e3) + s * 10 * step_ns,
                        end_ns=int(t.end_us * 1e3) + s * 10 * step_ns,
                        held_bytes=0,
                    )
                    for t in simulation.timeline(rank)
                ),
            )
            for s in range(steps)
        ]
    return run


def test_calibration_recovers_the_run_true_costs() -> None:
    profiled, truth = profile(1.0, 50.0), profile(2.0, 50.0, receive_cpu_us=350.0)
    plans = [schedule(2, 4, layer_names=NAMES) for schedule in (one_f_one_b, zb_h1)]
    in_situ = calibrate_in_situ(profiled, [(plan, as_run(plan, truth)) for plan in plans])
    assert in_situ.factors[0]["F"] == pytest.approx(2.0) and in_situ.factors[1]["W"] == pytest.approx(2.0)
    assert in_situ.latency_us == 50.0  # the probe's: the rest of a message's time is the runtime's
    assert in_situ.receive_cpu_us == pytest.approx(350.0, rel=0.01)
    for receive, latency in in_situ.fitted:
        assert not receive.clamped and (latency.low, latency.high) == (25.0, 100.0)
    assert in_situ.profile.runtime.receive.fixed_us == pytest.approx(350.0, rel=0.01)
    for mine, true in zip(in_situ.profile.layers, truth.layers, strict=True):
        assert mine.forward_duration_us == pytest.approx(true.forward_duration_us)
        assert mine.backward_weight_duration_us == pytest.approx(true.backward_weight_duration_us)
    # and so predicts a plan it never saw as the truth does
    other = one_f_one_b(2, 8, layer_names=NAMES)
    predicted = simulate(other, local_cost_model(other, in_situ.profile)).estimate.step_time_us
    actual = simulate(other, local_cost_model(other, truth)).estimate.step_time_us
    assert predicted == pytest.approx(actual, rel=0.01)
    with pytest.raises(ValueError, match="share their stages"):
        calibrate_in_situ(
            profiled,
            [
                (plans[0], as_run(plans[0], truth)),
                (zb_h1(2, 4, layer_names=[["l0"], ["l1", "l2", "l3"]]), as_run(plans[0], truth)),
            ],
        )


def test_an_overhead_no_message_explains_leaves_the_link_within_the_probe_bounds() -> None:
    """Steps far longer than the profile's actions and any message: every fit is held at its bound and says
    so; the link's latency is at most twice the probe's."""
    profiled = profile(1.0, 50.0)
    plan = one_f_one_b(2, 4, layer_names=NAMES)
    run = as_run(plan, profiled)
    slow = RunResult(losses=run.losses)
    for rank, steps in run.timelines.items():  # the same actions, each step ending 100x later
        slow.timelines[rank] = [
            dataclasses.replace(t, end_ns=t.start_ns + 100 * (t.end_ns - t.start_ns)) for t in steps
        ]
    in_situ = calibrate_in_situ(profiled, [(plan, slow)])
    ((receive, latency),) = in_situ.fitted
    assert receive.clamped and latency.clamped
    assert in_situ.latency_us == 100.0 <= 2 * 50.0
