"""Re-tuning from measured timelines (the closed loop's decision), torch-free and without gRPC.

Timelines are written here from known "true" costs (the profile's times x a
factor per stage), so the calibrated costs and every candidate's predicted
step are known exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from octopipe.ir import Action, ActionKind, StageSpec, action_to_proto, add_p2p_actions, build_plan, rank_actions
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import LOCAL_GLOO_LINK, local_cost_model, simulate, verify_plan
from octopipe.tune import (
    DEFAULT_SCHEDULES,
    Placement,
    ScheduleEntry,
    calibrated_costs,
    gpipe,
    measured_gain,
    replan,
    retune,
    zb_h1,
    zb_v,
)

LINEAR = {"gpipe", "1f1b", "zb-h1", "zb-h2"}
V = {"zb-v", "v-half", "v-min", "dualpipe-v"}


def profile_of(count: int) -> profile_pb2.Profile:
    """Layers with F 10(i+1), I 5, W 4, fused B 8 us; 1 MB activations; no measured link."""
    profile = profile_pb2.Profile(microbatch_size=1)
    for i in range(count):
        layer = profile.layers.add(
            layer_name=f"l{i}",
            forward_duration_us=10.0 * (i + 1),
            backward_input_duration_us=5.0,
            backward_weight_duration_us=4.0,
            full_backward_duration_us=8.0,
            activation_saved_bytes=1 << 20,
        )
        layer.output_tensors.add(shape=[8], dtype="float32", size_bytes=32)
    return profile


def timelines(
    plan: plan_pb2.Plan, profile: profile_pb2.Profile, factors: Mapping[int, float]
) -> list[profile_pb2.RankTimeline]:
    """Each rank's compute actions back to back, each taking its stage's profiled time x ``factors[stage]``."""
    layers = {layer.layer_name: layer for layer in profile.layers}
    field = {
        ActionKind.FORWARD: "forward_duration_us",
        ActionKind.BACKWARD_INPUT: "backward_input_duration_us",
        ActionKind.BACKWARD_WEIGHT: "backward_weight_duration_us",
        ActionKind.FULL_BACKWARD: "full_backward_duration_us",
    }
    out = []
    for rank, actions in rank_actions(plan).items():
        timeline, clock = profile_pb2.RankTimeline(rank=rank, step=1), 0.0
        for action in actions:
            for part in action.computations if action.kind.is_compute else ():
                names = plan.stages[part.stage].layer_names
                duration = factors[part.stage] * sum(getattr(layers[n], field[part.kind]) for n in names)
                timeline.records.add(action=action_to_proto(part), start_us=clock, end_us=clock + duration)
                clock += duration
        out.append(timeline)
    return out


def sequential(ranks: int, m: int, names: list[list[str]]) -> plan_pb2.Plan:
    """One micro-batch at a time through the whole pipe: correct, and slow."""
    compute: dict[int, list[Action]] = {r: [] for r in range(ranks)}
    for mb in range(m):
        for stage in range(ranks):
            compute[stage].append(Action(ActionKind.FORWARD, stage, mb))
        for stage in reversed(range(ranks)):
            compute[stage].append(Action(ActionKind.FULL_BACKWARD, stage, mb))
    return build_plan(
        stages=[StageSpec(rank=r, layer_names=tuple(names[r])) for r in range(ranks)],
        actions=add_p2p_actions(compute, {s: s for s in range(ranks)}),
        num_microbatches=m,
        name="sequential",
        labels={"schedule": "sequential"},
    )


def test_calibrated_costs_take_the_measured_times_on_the_local_link() -> None:
    profile = profile_of(4)
    plan = gpipe(2, 4, layer_names=[["l0", "l1"], ["l2", "l3"]])
    costs = calibrated_costs(plan, profile, timelines(plan, profile, {0: 2.0, 1: 0.5}))
    assert costs.stages[0].forward_us == pytest.approx(2.0 * 30.0)
    assert costs.stages[1].forward_us == pytest.approx(0.5 * 70.0)
    assert costs.default_link == LOCAL_GLOO_LINK  # the profile measured no link
    truth = profile_of(4)
    for layer in truth.layers:
        factor = 2.0 if layer.layer_name in ("l0", "l1") else 0.5
        for name in ("forward_duration_us", "full_backward_duration_us"):
            setattr(layer, name, getattr(layer, name) * factor)
    assert simulate(plan, costs).estimate.step_time_us == pytest.approx(
        simulate(plan, local_cost_model(plan, truth)).estimate.step_time_us
    )


def test_a_slow_plan_is_retuned_and_every_candidate_is_reported() -> None:
    profile = profile_of(4)
    names = [["l0", "l1"], ["l2", "l3"]]
    plan = sequential(2, 4, names)
    result = retune(plan, profile, timelines(plan, profile, {0: 1.0, 1: 1.0}))
    assert set(result.candidates) == {"current"} | LINEAR | {"list", "list-zb"}
    assert set(result.skipped) >= V | {"interleaved-1f1b", "interleaved-1f1b-4"}
    assert "placement is not the running plan's" in result.skipped["zb-v"]
    assert result.candidates["current"] == result.current_us
    assert result.best_us == min(result.candidates.values()) == result.candidates[result.name]
    assert result.name != "current" and result.predicted_gain > 1.2
    assert result.plan.labels["schedule"] == result.name
    assert [list(s.layer_names) for s in result.plan.stages] == names
    costs = calibrated_costs(plan, profile, timelines(plan, profile, {0: 1.0, 1: 1.0}))
    assert simulate(result.plan, costs).estimate.step_time_us == result.best_us
    verify_plan(result.plan, costs)


def test_a_registered_schedule_is_a_retune_candidate() -> None:
    """ZB-H1 under a new name: the closed loop predicts it exactly as ZB-H1."""
    toy = ScheduleEntry(name="toy-zb", placement=Placement.linear(), generator=zb_h1, split_backward=True)
    profile = profile_of(4)
    plan = sequential(2, 4, [["l0", "l1"], ["l2", "l3"]])
    measured = timelines(plan, profile, {0: 1.0, 1: 1.0})
    result = retune(plan, profile, measured, registry=DEFAULT_SCHEDULES.with_entry(toy))
    assert result.candidates["toy-zb"] == result.candidates["zb-h1"]
    assert "toy-zb" not in retune(plan, profile, measured).candidates


def test_a_v_plan_is_retuned_among_the_v_schedules() -> None:
    profile = profile_of(8)
    plan = zb_v(2, 4, layer_names=[[f"l{2 * s}", f"l{2 * s + 1}"] for s in range(4)])
    result = retune(plan, profile, timelines(plan, profile, dict.fromkeys(range(4), 1.0)))
    assert set(result.candidates) == {"current", "list", "list-zb"} | V
    assert result.candidates["zb-v"] == result.current_us  # the running order itself
    assert result.best_us <= result.current_us


def test_the_running_plan_is_kept_unless_a_candidate_is_faster() -> None:
    profile = profile_of(2)
    plan = gpipe(1, 3, layer_names=[["l0", "l1"]])  # one rank: every order takes the same time
    result = retune(plan, profile, timelines(plan, profile, {0: 1.0}))
    assert result.name == "current" and result.predicted_gain == 1.0
    assert result.plan.labels["schedule"] == "current"
    assert len(set(result.candidates.values())) == 1


def test_measured_gain_is_the_median_before_and_after_the_first_switch() -> None:
    def step(step: int, rank: int, switches: int, duration: float) -> node_pb2.StepMetrics:
        return node_pb2.StepMetrics(step=step, rank=rank, plan_switches=switches, step_duration_us=duration)

    before = [step(s, r, 0, 100.0 + s + 10 * r) for s in range(4) for r in range(2)]  # slowest rank: 110 + s
    after = [step(s, 0, 1, 50.0 + s) for s in range(4, 8)]
    assert measured_gain(before + after) == (112.0, 56.0)  # the first step of each left out
    assert measured_gain(before) is None  # no switch
    assert measured_gain(before + after[:1]) is None  # too few steps after it


def test_replan_tunes_the_same_layers_for_fewer_ranks_with_the_calibrated_costs() -> None:
    profile = profile_of(8)
    names = [layer.layer_name for layer in profile.layers]
    old = zb_h1(4, 8, layer_names=[names[2 * i : 2 * i + 2] for i in range(4)])
    old.model.name, old.model.source = "m", "pkg:fn"
    measured = timelines(old, profile, {0: 3.0, 1: 1.0, 2: 1.0, 3: 1.0})  # stage 0 runs 3x slower than profiled
    result = replan(old, profile, measured, 2, time_budget_s=5)
    plan = result.plan
    verify_plan(plan)
    assert len(plan.ranks) == 2 and plan.num_microbatches == 8
    assert sorted(n for s in plan.stages for n in s.layer_names) == sorted(names)
    assert plan.model == old.model and plan.labels["schedule"]
    # the tuner planned with the calibrated costs (l0 and l1 three times slower): a longer step than planned
    # from the profile alone, and never more layers beside l0
    plain = replan(old, profile, [], 2, time_budget_s=5)
    assert result.estimate.step_time_us > plain.estimate.step_time_us
    with_l0 = [len(s.layer_names) for r in (result, plain) for s in r.plan.stages if "l0" in s.layer_names]
    assert with_l0[0] <= with_l0[1]
    with pytest.raises(ValueError, match="at least 9 layers"):
        replan(old, profile, measured, 9)
