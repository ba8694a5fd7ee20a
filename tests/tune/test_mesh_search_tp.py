"""The mesh search over pp x dp x tp x cp: tp where a model does not fit otherwise, cp only without Mamba,
the pp x dp search unchanged, and the lower bound that prunes meshes never above a simulated step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from octopipe.ir import plan_to_text
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, GroupLinks, Link, OverlapModel, simulate
from octopipe.tune import MeshTuneConfig, scale_microbatches, tune_mesh
from octopipe.tune.mesh_parallel import parallel_degrees, step_lower_bound_us
from octopipe.tune.problem import Layers

CAP = 10_000
LINKS = GroupLinks(
    data_parallel=Link(latency_us=5.0, bandwidth_bytes_per_second=1e9),
    tensor_parallel=Link(latency_us=1.0, bandwidth_bytes_per_second=1e10),
    context_parallel=Link(latency_us=2.0, bandwidth_bytes_per_second=5e9),
)
FACTS = {"heads": 8, "ffn": 64, "sequence": 128}


def _profile(kinds: list[str], *, static: int = 1000, activation: int = 100, output: int = 100) -> profile_pb2.Profile:
    profile = profile_pb2.Profile(device="test", microbatch_size=1)
    for index, kind in enumerate(kinds):
        layer = profile.layers.add(
            layer_name=f"layers.{index}",
            layer_type=kind,
            forward_duration_us=100.0,
            backward_input_duration_us=110.0,
            backward_weight_duration_us=90.0,
            activation_saved_bytes=activation,
            activation_freed_by_backward_weight_bytes=activation,
            parameter_bytes=static // 4,
            gradient_bytes=static // 4,
            optimizer_state_bytes=static // 2,
        )
        layer.output_tensors.add(shape=[1, output], dtype="uint8", size_bytes=output)
    profile.collectives.extend(LINKS.to_proto())
    for source in range(8):
        for destination in range(8):
            if source != destination:
                profile.links.add(
                    source_rank=source, destination_rank=destination, latency_us=3.0, bandwidth_bytes_per_second=1e9
                )
    return profile


def _resimulated(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> float:
    model = CostModel.from_profile(plan, profile, overlap=OverlapModel(hidden_fraction=0.0))
    return simulate(plan, model).estimate.step_time_us


def test_tp_is_chosen_when_no_pipeline_split_fits_the_cap() -> None:
    """Two layers of 1.5 caps of static bytes each, 4 devices, 2 samples: without tp the only mesh is pp = 2 x
    dp = 2, whose device holds half its layer's static bytes plus its unsharded parameters and gradients (1.5
    caps); tp = 2 (or 4) with dp = 1 holds 0.75 caps. Without tp there is no plan."""
    profile = _profile(["attention+swiglu"] * 2, static=15_000)
    config = MeshTuneConfig(devices=4, global_batch=2, memory_cap_bytes=CAP, model_facts=FACTS)
    result = tune_mesh(profile, config)
    assert result.tp > 1
    assert result.pp * result.dp * result.tp * result.cp == 4
    assert (result.plan.mesh.tp or 1) == result.tp and (result.plan.mesh.cp or 1) == result.cp
    assert max(r.peak_memory_bytes for r in result.estimate.ranks) <= CAP
    # the plan and the profile alone give the tuner's prediction (CostModel.from_profile reads the mesh; the
    # tuner's OVERLAP_F_B units cost F + B)
    assert _resimulated(result.plan, profile) == result.estimate.step_time_us
    with pytest.raises(ValueError, match="memory cap"):
        tune_mesh(profile, replace(config, tensor_parallel=False))


def test_cp_is_searched_for_attention_only_models_and_chosen_when_activations_need_it() -> None:
    """Activations of 1.5 caps per micro-batch: only cp (which splits the sequence) brings them under it."""
    profile = _profile(["attention+swiglu"] * 2, static=100, activation=15_000, output=100)
    config = MeshTuneConfig(
        devices=4, global_batch=1, memory_cap_bytes=CAP, model_facts=FACTS, tp_degrees=(1,), cp_degrees=(2, 4)
    )
    result = tune_mesh(profile, config)
    assert result.cp > 1 and result.tp == 1
    assert result.plan.mesh.cp == result.cp
    assert _resimulated(result.plan, profile) == result.estimate.step_time_us


def test_cp_is_never_tried_on_a_model_with_mamba_layers() -> None:
    mamba = _profile(["mamba2", "attention", "relu2", "mamba2"])
    choice = parallel_degrees(mamba, 16, facts=FACTS, tp_degrees=None, cp_degrees=None, node_size=8, max_cp=32)
    assert {cp for _, cp in choice.pairs} == {1}
    assert {tp for tp, _ in choice.pairs} == {1, 2, 4, 8}
    assert any("Mamba" in why for why in choice.excluded)
    attention = _profile(["attention", "relu2"] * 2)
    choice = parallel_degrees(attention, 16, facts=FACTS, tp_degrees=None, cp_degrees=None, node_size=8, max_cp=32)
    assert {cp for _, cp in choice.pairs} == {1, 2, 4, 8, 16}
    assert choice.pairs[0] == (1, 1)
    assert all(16 % (tp * cp) == 0 for tp, cp in choice.pairs)
    # even when asked for: a Mamba model gets cp = 1 (the runtime cannot split its scan)
    config = MeshTuneConfig(devices=4, global_batch=4, memory_cap_bytes=10**9, cp_degrees=(2,), tp_degrees=(1,))
    result = tune_mesh(mamba, config)
    assert all(c.cp == 1 for c in result.candidates) and result.cp == 1


def test_tp_respects_the_head_count_and_the_node() -> None:
    """tp divides the heads (6 heads: 1, 2, 3, 6 of the divisors of 12 devices up to the node of 8)."""
    choice = parallel_degrees(
        _profile(["attention"]), 12, facts={"heads": 6}, tp_degrees=None, cp_degrees=None, node_size=8, max_cp=32
    )
    assert [tp for tp, _ in choice.pairs] == [1, 2, 3, 6]


def test_without_tensor_parallelism_the_search_is_the_pp_dp_search() -> None:
    """tensor_parallel=False, no model facts, and tp = cp = 1 given explicitly choose the same plan."""
    profile = _profile(["attention+swiglu"] * 4)
    base = MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**9)
    plain = tune_mesh(profile, base)
    off = tune_mesh(profile, replace(base, tensor_parallel=False, model_facts=FACTS))
    ones = tune_mesh(profile, replace(base, model_facts=FACTS, tp_degrees=(1,), cp_degrees=(1,)))
    for other in (off, ones):
        assert plan_to_text(other.plan) == plan_to_text(plain.plan)
        assert other.estimate.step_time_us == plain.estimate.step_time_us
        assert other.candidates == plain.candidates
    assert not plain.plan.mesh.tp and not plain.plan.mesh.cp and plain.tp == plain.cp == 1


def test_searched_meshes_carry_tp_cp_and_the_bound_never_exceeds_a_simulated_step() -> None:
    profile = _profile(["attention+swiglu"] * 4)
    config = MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**9, model_facts=FACTS)
    result = tune_mesh(profile, config)
    tried = [c for c in result.candidates if c.step_time_us > 0]
    assert {(c.tp, c.cp) for c in tried} > {(1, 1)}
    for c in tried:
        scaled = scale_microbatches(profile, c.microbatch_size)
        layers = replace(Layers.from_profile(scaled), tp=c.tp, cp=c.cp)
        assert step_lower_bound_us(layers, c.pp, c.num_microbatches, 0.0) <= c.step_time_us * (1 + 1e-12)
    assert result.estimate.step_time_us <= min(c.step_time_us for c in tried if c.fits)


def test_bad_degrees_are_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        MeshTuneConfig(devices=8, global_batch=8, memory_cap_bytes=1, tp_degrees=(3,))


def test_runtime_limit_tp_cp_only_with_dp_1() -> None:
    """tp_cp_with_dp=False (the runtime today): a mesh with tp or cp > 1 is tried only with dp = 1."""
    profile = _profile(["attention+swiglu"] * 4)
    config = MeshTuneConfig(devices=8, global_batch=16, memory_cap_bytes=10**9, model_facts=FACTS, tp_cp_with_dp=False)
    result = tune_mesh(profile, config)
    parallel = [c for c in result.candidates if c.tp * c.cp > 1]
    assert parallel and all(c.dp == 1 or "dp = 1" in c.reason for c in parallel)
    assert any(c.dp == 1 and c.step_time_us > 0 for c in parallel)
    assert result.tp * result.cp == 1 or result.dp == 1
