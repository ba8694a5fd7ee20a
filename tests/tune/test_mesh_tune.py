"""Choosing pp x dp x m with FSDP collectives: placement rules, the cap, the configuration arithmetic."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe.ir import Action, action_to_proto, add_p2p_actions, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, GroupLinks, Link, StageCost, simulate, verify_plan
from octopipe.tune import (
    DEFAULT_SCHEDULES,
    CollectivePlacement,
    MeshTuneConfig,
    place_collectives,
    scale_microbatches,
    tune_mesh,
)

IB = GroupLinks(data_parallel=Link(latency_us=5.0, bandwidth_bytes_per_second=5e4))


def mesh_profile(n: int, seed: int, *, params: int = 1000) -> profile_pb2.Profile:
    """Heterogeneous layers with parameters, gradients and optimizer state, and data-parallel costs."""
    rng = random.Random(seed)
    profile = profile_pb2.Profile(device="test", microbatch_size=1)
    for index in range(n):
        f, i, w, act = [(30.0, 60.0, 10.0, 300), (6.0, 10.0, 3.0, 60), (12.0, 12.0, 12.0, 60)][rng.randrange(3)]
        layer = profile.layers.add(
            layer_name=f"layers.{index}",
            layer_type="test",
            forward_duration_us=f,
            backward_input_duration_us=i,
            backward_weight_duration_us=w,
            activation_saved_bytes=act,
            activation_freed_by_backward_input_bytes=act // 2,
            activation_freed_by_backward_weight_bytes=act - act // 2,
            parameter_bytes=params,
            gradient_bytes=params,
            optimizer_state_bytes=2 * params,
        )
        layer.output_tensors.add(shape=[10], dtype="uint8", size_bytes=10)
    profile.collectives.extend(IB.to_proto())
    return profile


def replace_programs(plan: plan_pb2.Plan, placed: dict[int, list[Action]], placement: tuple[int, ...]) -> None:
    """Lower ``placed`` (p2p added) into ``plan``'s rank programs."""
    for rank, actions in add_p2p_actions(placed, dict(enumerate(placement))).items():
        del plan.ranks[rank].actions[:]
        plan.ranks[rank].actions.extend(action_to_proto(a) for a in actions)


@pytest.mark.parametrize("name", [entry.name for entry in DEFAULT_SCHEDULES.tunable])
@pytest.mark.parametrize(
    "policy",
    [CollectivePlacement(), CollectivePlacement(reshard=True), CollectivePlacement(prefetch=False, reshard=True)],
    ids=["prefetch", "prefetch-reshard", "just-in-time"],
)
def test_placed_collectives_verify_on_every_library_schedule(name: str, policy: CollectivePlacement) -> None:
    entry = DEFAULT_SCHEDULES.entry(name)
    plan = entry.generate(3, 6)
    placement = entry.placement.stage_ranks(3)
    compute = {r: [a for a in actions if a.kind.is_compute] for r, actions in rank_actions(plan).items()}
    placed = place_collectives(compute, placement, policy)
    for rank, actions in placed.items():
        texts = [str(a) for a in actions]
        for s in (s for s, r in enumerate(placement) if r == rank):
            uses = [i for i, a in enumerate(actions) if a.kind.is_compute and any(c.stage == s for c in a.computations)]
            assert texts.index(f"{s}UNSHARD") < uses[0]
            assert texts.index(f"{s}REDUCE_GRAD") > uses[-1]
            assert (f"{s}RESHARD" in texts) == policy.reshard
            if policy.prefetch:  # every UNSHARD before the first computation
                assert texts.index(f"{s}UNSHARD") < min(i for i, a in enumerate(actions) if a.kind.is_compute)
    replace_programs(plan, placed, placement)
    plan.mesh.dp = 4
    verify_plan(plan)


def test_reshard_frees_a_v_rank_between_its_stages() -> None:
    """V placement, p = 2: rank 0 holds stages 0 and 3; just-in-time unsharding with RESHARD after last use
    never holds both stages' parameters unless their uses overlap, so its peak is no higher."""
    entry = DEFAULT_SCHEDULES.entry("zb-v")
    plan = entry.generate(2, 4)
    placement = entry.placement.stage_ranks(2)
    compute = {r: [a for a in actions if a.kind.is_compute] for r, actions in rank_actions(plan).items()}
    stage = StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1, parameter_bytes=1000, gradient_bytes=8)
    costs = CostModel.uniform(num_stages=4, stage=stage)
    peaks = []
    for policy in (CollectivePlacement(), CollectivePlacement(prefetch=False, reshard=True)):
        replace_programs(plan, place_collectives(compute, placement, policy), placement)
        plan.mesh.dp = 2
        verify_plan(plan)
        peaks.append(simulate(plan, costs).estimate.ranks[0].peak_memory_bytes)
    assert peaks[1] <= peaks[0]


def test_tune_mesh_chooses_a_consistent_configuration() -> None:
    profile = mesh_profile(12, seed=3)
    config = MeshTuneConfig(devices=16, global_batch=64, memory_cap_bytes=10**6, p2p_link=Link())
    result = tune_mesh(profile, config)
    assert result.pp * result.dp == 16
    assert result.num_microbatches * result.microbatch_size * result.dp == 64
    assert result.plan.mesh.dp == result.dp and len(result.plan.ranks) == result.pp
    verify_plan(result.plan)
    assert result.estimate.fits and result.estimate.step_time_us <= result.baseline.step_time_us
    assert result.baseline.num_microbatches == result.num_microbatches
    assert result.estimate.samples_per_step == result.baseline.samples_per_step == 64
    assert {c.pp for c in result.candidates if c.num_microbatches} == {1, 2, 4, 8}
    (too_deep,) = [c for c in result.candidates if c.pp == 16]  # 16 stages need 16 layers; 12 here
    assert "need at least 16 layers" in too_deep.reason
    chosen = [c for c in result.candidates if c.pp == result.pp]
    assert chosen and chosen[0].step_time_us == pytest.approx(result.estimate.step_time_us, rel=0.2)
    assert [n for s in result.plan.stages for n in s.layer_names] == [f"layers.{i}" for i in range(12)]


def test_microbatch_count_is_capped_by_growing_the_microbatch() -> None:
    profile = mesh_profile(8, seed=1)
    config = MeshTuneConfig(
        devices=4, global_batch=64, memory_cap_bytes=10**7, pipeline_degrees=(2,), max_microbatches=8
    )
    result = tune_mesh(profile, config)
    assert (result.pp, result.dp, result.num_microbatches, result.microbatch_size) == (2, 2, 8, 4)
    scaled = scale_microbatches(profile, 4)
    assert scaled.microbatch_size == 4
    assert scaled.layers[0].forward_duration_us == 4 * profile.layers[0].forward_duration_us
    assert scaled.layers[0].activation_saved_bytes == 4 * profile.layers[0].activation_saved_bytes
    assert scaled.layers[0].parameter_bytes == profile.layers[0].parameter_bytes
    assert scaled.layers[0].output_tensors[0].size_bytes == 40


def test_no_configuration_fits_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="raise the cap"):
        tune_mesh(mesh_profile(8, seed=1), MeshTuneConfig(devices=4, global_batch=8, memory_cap_bytes=100))
    with pytest.raises(ValueError, match="no collective costs"):
        profile = mesh_profile(8, seed=1)
        del profile.collectives[:]
        tune_mesh(profile, MeshTuneConfig(devices=4, global_batch=8, memory_cap_bytes=10**9))
    with pytest.raises(ValueError, match="does not divide"):
        MeshTuneConfig(devices=8, global_batch=8, memory_cap_bytes=1, pipeline_degrees=(3,))


@settings(max_examples=12, deadline=None)
@given(
    devices=st.sampled_from([2, 4, 8]),
    batch=st.sampled_from([8, 16]),
    cap=st.integers(2_000, 40_000),
    seed=st.integers(0, 100),
)
def test_tuner_never_breaks_the_cap(devices: int, batch: int, cap: int, seed: int) -> None:
    profile = mesh_profile(6, seed=seed)
    try:
        result = tune_mesh(profile, MeshTuneConfig(devices=devices, global_batch=batch, memory_cap_bytes=cap))
    except ValueError as exc:
        assert "memory cap" in str(exc)
        return
    assert all(r.peak_memory_bytes <= cap for r in result.estimate.ranks)
    assert all(p.memory_cap_bytes == cap for p in result.plan.ranks)
    scaled = scale_microbatches(profile, result.microbatch_size)
    verify_plan(result.plan, CostModel.from_profile(result.plan, scaled, default_link=Link()))


def test_refinement_never_makes_the_choice_slower() -> None:
    profile = mesh_profile(12, seed=5)
    config = MeshTuneConfig(devices=8, global_batch=32, memory_cap_bytes=10**6, pipeline_degrees=(4,))
    plain = tune_mesh(profile, config)
    refined = tune_mesh(profile, MeshTuneConfig(**{**vars(config), "refine_s": 5.0}))
    verify_plan(refined.plan)
    assert refined.estimate.step_time_us <= plain.estimate.step_time_us
    assert refined.simulations >= plain.simulations


def test_expert_parallel_all_to_alls_are_paid() -> None:
    profile = mesh_profile(8, seed=2)
    for layer in profile.layers[1::2]:
        layer.all_to_all_bytes = 5000
    profile.collectives.add(
        group=profile_pb2.GROUP_KIND_EXPERT_PARALLEL, latency_us=1.0, bandwidth_bytes_per_second=1e5
    )
    config = MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**6, pipeline_degrees=(2,))
    without = tune_mesh(profile, config)
    with_ep = tune_mesh(profile, MeshTuneConfig(**{**vars(config), "ep": 4}))
    assert (without.plan.mesh.ep, with_ep.plan.mesh.ep) == (1, 4)
    assert with_ep.estimate.step_time_us > without.estimate.step_time_us
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        tune_mesh(profile, MeshTuneConfig(**{**vars(config), "ep": 3}))


def moe_profile() -> profile_pb2.Profile:
    """Every other layer a MoE layer of 4 experts holding most of its parameters in them."""
    profile = mesh_profile(8, seed=2)
    for layer in profile.layers[1::2]:
        layer.parameter_bytes = layer.gradient_bytes = 20_000
        layer.optimizer_state_bytes = 40_000
        layer.expert_parameter_bytes = 18_000
        layer.num_experts = 4
        layer.all_to_all_bytes = 500
    profile.collectives.add(
        group=profile_pb2.GROUP_KIND_EXPERT_PARALLEL, latency_us=1.0, bandwidth_bytes_per_second=1e5
    )
    return profile


def test_expert_parallelism_is_searched_where_the_model_has_experts() -> None:
    """dp=4 and 4 experts: ep 1, 2 and 4 are tried; under a cap only experts split over devices fit."""
    profile = moe_profile()
    config = MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**7, pipeline_degrees=(2,))
    free = tune_mesh(profile, config)
    assert sorted(c.ep for c in free.candidates) == [1, 2, 4]
    assert free.plan.mesh.ep == free.ep
    peak = {c.ep: c.peak_memory_bytes for c in free.candidates}
    assert peak[4] < peak[2] < peak[1]  # fewer experts per device
    cap = (peak[1] + peak[2]) // 2
    with pytest.raises(ValueError, match="memory cap"):
        tune_mesh(profile, MeshTuneConfig(**{**vars(config), "memory_cap_bytes": min(cap, peak[1] - 1), "ep": 1}))
    capped = tune_mesh(profile, MeshTuneConfig(**{**vars(config), "memory_cap_bytes": cap}))
    assert capped.ep in (2, 4) and capped.estimate.fits
    verify_plan(capped.plan)
    # 8 replicas, 4 experts: ep 8 would leave a device without an expert
    wide = tune_mesh(profile, MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**7, pipeline_degrees=(1,)))
    assert sorted(c.ep for c in wide.candidates) == [1, 2, 4]
    # no MoE layer: ep stays 1
    dense = tune_mesh(mesh_profile(8, seed=2), config)
    assert {c.ep for c in dense.candidates} == {1}
