"""The list scheduler, the co-optimizer and the exact baseline."""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe.ir import add_p2p_actions
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Link, StageCost, StageSpec, build_plan, simulate, verify_plan
from octopipe.tune import (
    ListSchedulerConfig,
    TuneConfig,
    balanced_bounds,
    equal_bounds,
    list_schedule,
    one_f_one_b,
    tune,
    v_placement,
    zb_h1,
    zb_v,
)


def profile_of(costs: list[tuple[float, float, float, int]], *, static: int = 0, out: int = 0) -> profile_pb2.Profile:
    """A Profile with one layer per (F, I, W, activation bytes); I frees half the activations."""
    profile = profile_pb2.Profile(device="test", microbatch_size=1)
    for index, (f, i, w, act) in enumerate(costs):
        layer = profile.layers.add(
            layer_name=f"layers.{index}",
            layer_type="test",
            forward_duration_us=f,
            backward_input_duration_us=i,
            backward_weight_duration_us=w,
            activation_saved_bytes=act,
            activation_freed_by_backward_input_bytes=act // 2,
            activation_freed_by_backward_weight_bytes=act - act // 2,
            parameter_bytes=static,
        )
        if out:
            layer.output_tensors.add(shape=[out], dtype="uint8", size_bytes=out)
    return profile


def plan_from(compute: dict, placement: list[int], m: int, caps: dict[int, int] | None = None):  # type: ignore[no-untyped-def]
    stages = [StageSpec(rank=r) for r in placement]
    actions = add_p2p_actions(compute, dict(enumerate(placement)))
    return build_plan(stages=stages, actions=actions, num_microbatches=m, memory_caps=caps)


# --- the list scheduler ---


@pytest.mark.parametrize("placement", [[0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3], v_placement(4), [0, 0, 1, 1, 2, 3]])
@pytest.mark.parametrize("priority", ["backward", "forward"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_list_schedule_verifies_for_any_placement(placement: list[int], priority: str, split: bool, m: int) -> None:
    rng = random.Random(len(placement) * 100 + m)
    stages = tuple(
        StageCost(
            forward_us=rng.randint(1, 5),
            backward_input_us=rng.randint(1, 5),
            backward_weight_us=rng.randint(1, 3),
            activation_bytes=4,
            freed_by_backward_input_bytes=2,
        )
        for _ in placement
    )
    costs = CostModel(stages=stages, default_link=Link(latency_us=0.5))
    config = ListSchedulerConfig(priority=priority, split_backward=split)  # type: ignore[arg-type]
    plan = plan_from(list_schedule(costs, placement, m, config=config), placement, m)
    verify_plan(plan)


def test_list_schedule_reproduces_1f1b_under_its_memory() -> None:
    """Backward first, no split, at most p-r micro-batches on rank r: exactly 1F1B's order and step time."""
    p, m = 4, 8
    costs = CostModel.uniform(num_stages=p, stage=StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1))
    config = ListSchedulerConfig(split_backward=False, max_in_flight=[p - r for r in range(p)])
    compute = list_schedule(costs, list(range(p)), m, config=config)
    reference = one_f_one_b(p, m)
    assert simulate(plan_from(compute, list(range(p)), m), costs).estimate.step_time_us == (
        simulate(reference, costs).estimate.step_time_us
    )


def test_list_schedule_keeps_memory_caps_and_moves_w_earlier() -> None:
    """A cap of 2 micro-batches per rank: W's run as soon as a forward would not fit."""
    p, m = 4, 8
    stage = StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1, activation_bytes=10)
    costs = CostModel.uniform(num_stages=p, stage=stage)
    caps = dict.fromkeys(range(p), 20)
    compute = list_schedule(costs, list(range(p)), m, memory_caps=caps)
    estimate = simulate(plan_from(compute, list(range(p)), m, caps), costs).estimate  # raises over a cap
    assert max(r.peak_activation_bytes for r in estimate.ranks) == 20
    unlimited = simulate(plan_from(list_schedule(costs, list(range(p)), m), list(range(p)), m), costs).estimate
    assert max(r.peak_activation_bytes for r in unlimited.ranks) > 20
    with pytest.raises(ValueError, match="cannot hold"):
        list_schedule(costs, list(range(p)), m, memory_caps=dict.fromkeys(range(p), 5))


def test_list_schedule_at_least_matches_zb_h1_on_unit_costs() -> None:
    p, m = 4, 16
    costs = CostModel.uniform(num_stages=p, stage=StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1))
    config = ListSchedulerConfig(priority="forward", max_in_flight=[p] * p, max_ahead=[p - r for r in range(p)])
    compute = list_schedule(costs, list(range(p)), m, config=config)
    ours = simulate(plan_from(compute, list(range(p)), m), costs).estimate.step_time_us
    assert ours <= simulate(zb_h1(p, m), costs).estimate.step_time_us


def test_list_scheduler_config_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="priority"):
        ListSchedulerConfig(priority="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        ListSchedulerConfig(max_in_flight=[0])
    costs = CostModel.uniform(num_stages=2, stage=StageCost(forward_us=1))
    with pytest.raises(ValueError, match="one rank per stage"):
        list_schedule(costs, [0], 2)
    with pytest.raises(ValueError, match="ranks \\[1\\] have no stage"):
        list_schedule(costs, [0, 2], 2)


# --- partitions ---


def test_balanced_bounds_minimise_the_heaviest_stage() -> None:
    weights = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]
    bounds = balanced_bounds(weights, 4)
    heaviest = max(sum(weights[bounds[s] : bounds[s + 1]]) for s in range(4))
    assert heaviest == 9.0
    assert equal_bounds(10, 4) == (0, 3, 6, 8, 10)
    with pytest.raises(ValueError, match="at least as many layers"):
        equal_bounds(3, 4)


# --- the co-optimizer ---


def heterogeneous(n: int, seed: int) -> profile_pb2.Profile:
    """Mamba-, attention- and MLP-like layers: times and activations differ by up to 6x."""
    rng = random.Random(seed)
    kinds = [(30.0, 60.0, 10.0, 300), (6.0, 10.0, 3.0, 60), (12.0, 12.0, 12.0, 60)]
    return profile_of([kinds[rng.randrange(3)] for _ in range(n)], static=50)


def test_tune_beats_1f1b_with_equal_counts_on_a_heterogeneous_profile() -> None:
    profile = heterogeneous(16, seed=1)
    result = tune(profile, TuneConfig(num_ranks=4, num_microbatches=8, kicks=1))
    assert result.estimate.step_time_us < result.baseline.step_time_us
    assert result.speedup > 1.0
    assert result.estimate.fits
    verify_plan(result.plan)
    assert all(r.HasField("memory_cap_bytes") for r in result.plan.ranks)
    assert [name for s in result.plan.stages for name in s.layer_names] == [f"layers.{i}" for i in range(16)]
    assert {report.phase.split(" ")[0] for report in result.phases} >= {"schedule", "partition"}


def test_tune_on_equal_layers_is_no_worse_than_the_library() -> None:
    """Equal layers: the tuned plan is at least as good as every library schedule that fits the same caps."""
    p, m = 4, 8
    profile = profile_of([(1.0, 1.0, 1.0, 10)] * 8)
    result = tune(profile, TuneConfig(num_ranks=p, num_microbatches=m, kicks=0))
    cap = result.memory_caps[0]
    names = [[f"layers.{2 * s}", f"layers.{2 * s + 1}"] for s in range(p)]
    for schedule in (one_f_one_b, zb_h1):
        plan = schedule(p, m, layer_names=names)
        estimate = simulate(plan, CostModel.from_profile(plan, profile, default_link=Link())).estimate
        assert all(r.peak_memory_bytes <= cap for r in estimate.ranks)
        assert result.estimate.step_time_us <= estimate.step_time_us
    v_names = [[f"layers.{s}"] for s in range(2 * p)]
    plan = zb_v(p, m, layer_names=v_names)
    estimate = simulate(plan, CostModel.from_profile(plan, profile, default_link=Link())).estimate
    if all(r.peak_memory_bytes <= cap for r in estimate.ranks):
        assert result.estimate.step_time_us <= estimate.step_time_us


def test_tune_is_deterministic_for_a_seed() -> None:
    profile = heterogeneous(12, seed=3)
    config = TuneConfig(num_ranks=3, num_microbatches=6, kicks=2, seed=7)
    first, second = tune(profile, config), tune(profile, config)
    assert first.plan == second.plan
    assert first.estimate.step_time_us == second.estimate.step_time_us


def test_tune_returns_1f1b_unless_a_plan_beats_it_by_more_than_the_error() -> None:
    """``min_gain``: the simpler plan wins unless the predicted gain exceeds the simulator's error (issue 15)."""
    profile = heterogeneous(16, seed=1)
    config = TuneConfig(num_ranks=4, num_microbatches=8, kicks=1)
    fastest = tune(profile, config)
    gain = fastest.speedup - 1
    assert gain > 0.02 and fastest.fastest_step_us == fastest.estimate.step_time_us
    assert "fastest" in fastest.choice
    tiny = tune(profile, replace(config, min_gain=0.001))  # every simpler plan is slower by more: the fastest
    assert tiny.plan == fastest.plan and "slower by more than" in tiny.choice
    fast, linear = fastest.estimate.step_time_us, fastest.best_by_family["linear"]
    assert fastest.plan.labels["placement"] != "linear" and linear > fast  # the fastest here is not linear
    # from 1F1B on equal layers, each family's best (in FAMILIES order) replaces the plan held only when it
    # is faster by more than min_gain: computed here from the per-family bests
    for min_gain in (0.004, 0.01, 0.02, (linear / fast - 1) * 1.05):
        held_name, held_us = "1f1b-equal", fastest.baseline.step_time_us
        for family in config.families:
            step = fastest.best_by_family.get(family, math.inf)
            if held_us > step * (1 + min_gain):
                held_name, held_us = family, step
        chosen = tune(profile, replace(config, min_gain=min_gain))
        assert chosen.estimate.step_time_us == held_us, (min_gain, held_name)
        assert held_us <= fast * (1 + min_gain)  # never more than the error slower than the fastest
        if held_name != "1f1b-equal":
            assert chosen.plan.labels["placement"] == held_name
        if held_us != fast:
            assert "no more complex plan is faster by more than" in chosen.choice
    within = tune(profile, replace(config, min_gain=gain * 1.1))  # within the error: 1F1B on equal layers
    assert within.plan.labels["schedule"] == "1f1b"
    assert [len(s.layer_names) for s in within.plan.stages] == [4, 4, 4, 4]
    assert within.estimate.step_time_us == within.baseline.step_time_us
    assert within.fastest_step_us == fastest.estimate.step_time_us
    assert f"only {gain:.1%} faster" in within.choice
    verify_plan(within.plan, CostModel.from_profile(within.plan, profile, default_link=Link()))
    with pytest.raises(ValueError, match="min_gain"):
        TuneConfig(num_ranks=2, num_microbatches=2, min_gain=1.5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    p=st.integers(2, 4),
    k=st.sampled_from([1, 2]),
    n_extra=st.integers(0, 6),
    tighten=st.sampled_from([1.0, 0.8]),
)
def test_tune_never_returns_a_plan_over_the_caps(seed: int, p: int, k: int, n_extra: int, tighten: float) -> None:
    rng = random.Random(seed)
    layers = [
        (rng.uniform(1, 30), rng.uniform(1, 40), rng.uniform(0, 15), rng.randrange(10, 400))
        for _ in range(2 * p + n_extra)
    ]
    profile = profile_of(layers, static=rng.randrange(0, 100), out=rng.choice([0, 8]))
    profile.links.extend(
        profile_pb2.LinkCost(source_rank=a, destination_rank=b, latency_us=0.5, bandwidth_bytes_per_second=1e6)
        for a in range(p)
        for b in range(p)
        if a != b
    )
    baseline = tune(profile, TuneConfig(num_ranks=p, num_microbatches=k * p, kicks=0, max_evaluations=1))
    cap = int(baseline.memory_caps[0] * tighten)
    try:
        result = tune(
            profile, TuneConfig(num_ranks=p, num_microbatches=k * p, kicks=1, memory_cap_bytes=cap, seed=seed)
        )
    except ValueError as exc:
        assert "no plan fits" in str(exc)
        return
    verify_plan(result.plan, profile)  # raises MemoryCapError over a cap
    assert all(r.peak_memory_bytes <= cap for r in result.estimate.ranks)
    if tighten == 1.0:
        assert result.estimate.step_time_us <= result.baseline.step_time_us


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 4), (2, 1), (3, 2)])
def test_tune_on_degenerate_sizes(p: int, m: int) -> None:
    profile = profile_of([(1.0, 2.0, 1.0, 10)] * 6)
    result = tune(profile, TuneConfig(num_ranks=p, num_microbatches=m))
    verify_plan(result.plan, CostModel.from_profile(result.plan, profile, default_link=Link()))
    assert result.estimate.step_time_us <= result.baseline.step_time_us


def test_tune_config_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="families"):
        TuneConfig(num_ranks=2, num_microbatches=2, families=("ring",))
    with pytest.raises(ValueError, match="at least 4 layers"):
        tune(profile_of([(1, 1, 1, 1)] * 3), TuneConfig(num_ranks=4, num_microbatches=4))
    with pytest.raises(ValueError, match="no plan fits") as refused:
        tune(profile_of([(1, 1, 1, 100)] * 4), TuneConfig(num_ranks=2, num_microbatches=4, memory_cap_bytes=10))
    # the refusal names the smallest peak reached, its plan's peaks and bytes over
    match = re.search(
        r"a cap of (\d+) bytes per rank fits it\).*whose peak per rank is \[(\d+), (\d+)\] bytes, (\d+) bytes over",
        str(refused.value),
    )
    assert match is not None, str(refused.value)
    peaks = [int(match.group(2)), int(match.group(3))]
    assert int(match.group(4)) == sum(max(0, peak - 10) for peak in peaks)
    assert int(match.group(1)) == max(peaks)


# --- the exact baseline ---


def test_exact_schedule_is_optimal_on_a_small_instance() -> None:
    pytest.importorskip("highspy")
    from octopipe.tune import exact_schedule

    p, m = 2, 4
    stage = StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1, activation_bytes=4)
    costs = CostModel.uniform(num_stages=p, stage=stage)
    result = exact_schedule(costs, [0, 1], m, time_limit_s=30)
    assert result.optimal
    # zero-bubble bound: the last rank cannot start before F of stage 0, nor rank 0 end before W after I of stage 1
    assert result.estimate.step_time_us == 3 * m + (p - 1)
    assert result.makespan_us == pytest.approx(result.estimate.step_time_us, abs=1e-4)
    verify_plan(result.plan)
    tight = exact_schedule(costs, [0, 1], m, memory_caps={0: 4, 1: 4}, time_limit_s=30)
    assert max(r.peak_memory_bytes for r in tight.estimate.ranks) <= 4
    assert tight.makespan_us > result.makespan_us


def test_exact_is_no_worse_than_the_list_scheduler() -> None:
    pytest.importorskip("highspy")
    from octopipe.tune import exact_schedule

    rng = random.Random(5)
    p, m = 3, 4
    stages = tuple(
        StageCost(
            forward_us=rng.randint(1, 4), backward_input_us=rng.randint(1, 4), backward_weight_us=rng.randint(1, 3)
        )
        for _ in range(p)
    )
    costs = CostModel(stages=stages, default_link=Link())
    heuristic = simulate(plan_from(list_schedule(costs, [0, 1, 2], m), [0, 1, 2], m), costs).estimate.step_time_us
    result = exact_schedule(costs, [0, 1, 2], m, time_limit_s=30, upper_bound_us=heuristic)
    assert result.estimate.step_time_us <= heuristic
    assert result.lower_bound_us <= result.makespan_us + 1e-6
