"""In-situ calibration recovers the costs a pipelined run really had (issue 15).

The "run" here is the simulator's own timeline of the plan under known true costs (every action twice
its profiled time, messages 400 us): a RunResult holding it must calibrate back to exactly those costs.
"""

from __future__ import annotations

import pytest

from octopipe.execute.runtime import ActionRecord, RunResult, StepTimeline
from octopipe.execute.runtime.pipeline import calibrate_in_situ
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate
from octopipe.tune import one_f_one_b, zb_h1

NAMES = [["l0", "l1"], ["l2", "l3"]]


def profile(scale: float, latency_us: float) -> profile_pb2.Profile:
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
    return profile_pb2.Profile(layers=layers, links=links)


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
    profiled, truth = profile(1.0, 50.0), profile(2.0, 400.0)
    plans = [schedule(2, 4, layer_names=NAMES) for schedule in (one_f_one_b, zb_h1)]
    in_situ = calibrate_in_situ(profiled, [(plan, as_run(plan, truth)) for plan in plans])
    assert in_situ.factors[0]["F"] == pytest.approx(2.0) and in_situ.factors[1]["W"] == pytest.approx(2.0)
    assert in_situ.latency_us == pytest.approx(400.0, rel=0.01)
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
