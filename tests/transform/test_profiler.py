"""The profiler: a Profile that round-trips through the proto, with costs that differ by layer type as the layers do."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import json_format

from octopipe.examples.models import ModelConfig, nemotron_h
from octopipe.profile.v1 import profile_pb2
from octopipe.transform import ProfilerConfig, format_profile, profile_layers, storage_bytes


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    torch.manual_seed(0)
    config = ModelConfig.tiny(hidden=64, vocab=512)
    model = nemotron_h("M-*E", config)
    tokens = torch.randint(0, 512, (2, 32))
    link = profile_pb2.LinkCost(source_rank=0, destination_rank=1, latency_us=90.0, bandwidth_bytes_per_second=3e9)
    return profile_layers(model, tokens, tokens, config=ProfilerConfig(repeats=3, warmup=1), links=[link])


def test_round_trips_through_the_proto(profile: profile_pb2.Profile) -> None:
    again = profile_pb2.Profile.FromString(profile.SerializeToString())
    assert again == profile
    assert json_format.Parse(json_format.MessageToJson(profile), profile_pb2.Profile()) == profile
    assert [c.layer_name for c in profile.layers] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert [c.layer_type for c in profile.layers] == ["embedding", "mamba2", "relu2", "attention", "moe", "head"]
    text = format_profile(profile)
    assert "layers.0" in text and "mamba2" in text and "link 0->1: latency 90.0 us" in text


def test_costs_differ_by_layer_type(profile: profile_pb2.Profile) -> None:
    by_type = {c.layer_type: c for c in profile.layers}
    mamba, mlp, moe, attention = by_type["mamba2"], by_type["relu2"], by_type["moe"], by_type["attention"]

    def total(c: profile_pb2.LayerCost) -> float:
        return c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us

    # timed, so only what no timing noise can flip: layers are measured one by one (not one copied number)
    assert len({total(c) for c in profile.layers}) > 1
    # bytes are exact, not timed: experts hold more weights than a dense MLP; the scan saves the most activations
    assert moe.parameter_bytes > mlp.parameter_bytes > 0
    assert mamba.activation_saved_bytes > max(mlp.activation_saved_bytes, attention.activation_saved_bytes)
    for cost in profile.layers:
        assert cost.forward_duration_us > 0 and cost.backward_weight_duration_us > 0
        assert cost.optimizer_state_bytes == 2 * cost.parameter_bytes
        assert (
            cost.activation_freed_by_backward_input_bytes + cost.activation_freed_by_backward_weight_bytes
            >= cost.activation_saved_bytes
        )
    boundary = profile.layers[1].output_tensors[0]
    assert (
        list(boundary.shape) == [2, 32, 64] and boundary.dtype == "float32" and boundary.size_bytes == 2 * 32 * 64 * 4
    )
    assert not profile.layers[-1].output_tensors  # the head ends in the loss


def test_storage_bytes_counts_storages_once() -> None:
    base = torch.zeros(256)
    assert storage_bytes([base, base[:10], base.view(16, 16)]) == 1024
    assert storage_bytes([base, torch.ones(4)], exclude=[base]) == 16
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        ProfilerConfig(repeats=0)


def test_scratch_is_what_an_action_frees_before_it_ends(profile: profile_pb2.Profile) -> None:
    """The allocator's peak above what an action leaves: the head's logits and softmax are freed inside the loss."""
    head = profile.layers[-1]
    logits = 2 * 32 * 512 * 4  # batch x sequence x vocab, float32
    # the forward ends in a scalar loss: a logits-sized intermediate comes and goes inside it (less the few
    # scalar bytes the forward allocates after it and keeps)
    assert head.forward_scratch_bytes >= logits - 64
    assert head.full_backward_scratch_bytes >= logits  # the gradient of the logits is made and freed
    for cost in profile.layers:
        # the weight-gradient action returns the gradients: at least their bytes pass through the allocator
        assert cost.backward_weight_scratch_bytes >= cost.parameter_bytes


def test_input_gradient_keeps_new_tensors_for_the_weight_gradient(profile: profile_pb2.Profile) -> None:
    """I makes each linear's output gradient and keeps it for W: not part of what F saved, counted apart."""
    for cost in profile.layers:
        kept = cost.backward_input_kept_bytes
        freed = cost.activation_freed_by_backward_input_bytes + cost.activation_freed_by_backward_weight_bytes
        assert freed == cost.activation_saved_bytes + kept  # W frees what I kept of F's and what I made
    mlp = next(c for c in profile.layers if c.layer_type == "relu2")
    assert mlp.backward_input_kept_bytes >= 2 * 32 * 64 * 4  # at least one hidden-sized output gradient


def test_graph_flops_counts_each_matmul_of_forward_and_backward() -> None:
    """A bias-free linear stage on a 4 x 16 batch to 8 features: one 2mkn matmul forward (1024 FLOPs), two
    backward (input and weight gradients, 1024 each); what MFU counts in ``octopipe train``."""
    from octopipe.capture import capture_stage
    from octopipe.transform import graph_flops

    stage = torch.nn.Linear(16, 8, bias=False)
    graphs = capture_stage(stage, [torch.randn(4, 16, requires_grad=True)], stage_index=0)
    assert graph_flops(graphs.forward) == 2 * 4 * 16 * 8
    assert graph_flops(graphs.backward) == 2 * (2 * 4 * 16 * 8)


def test_moe_layers_report_their_experts_for_the_mesh_search() -> None:
    """A MoE layer's experts, their bytes and the dispatch + combine all-to-all bytes of one forward."""
    from octopipe.examples.models import MoE, moe_decoder

    torch.manual_seed(0)
    model = moe_decoder(1, ModelConfig.tiny())
    tokens = torch.randint(0, model.config.vocab, (2, 8))
    profile = profile_layers(model, tokens, tokens, config=ProfilerConfig(repeats=1, warmup=0))
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    assert moes
    for layer in profile.layers:
        mine = [m for name, m in moes.items() if name.startswith(layer.layer_name + ".")]
        if not mine:
            assert (layer.num_experts, layer.expert_parameter_bytes, layer.all_to_all_bytes) == (0, 0, 0)
            continue
        (moe,) = mine
        assert layer.num_experts == moe.experts
        assert layer.expert_parameter_bytes == 4 * sum(w.numel() for w in (moe.w1, moe.w2, moe.w3))
        assert 0 < layer.expert_parameter_bytes < layer.parameter_bytes  # the router is not an expert
        assert layer.all_to_all_bytes == 2 * moe.experts * moe.capacity(2 * 8) * model.config.hidden * 4


def test_evicting_caches_between_samples_changes_no_byte_count_and_is_labelled(profile: profile_pb2.Profile) -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(hidden=64, vocab=512)
    model = nemotron_h("M-*E", config)
    tokens = torch.randint(0, 512, (2, 32))
    evicted = profile_layers(model, tokens, tokens, config=ProfilerConfig(repeats=1, warmup=0, evict_bytes=1 << 20))
    assert evicted.labels["evict_bytes"] == str(1 << 20) and profile.labels["evict_bytes"] == "0"
    timed = ("forwardDurationUs", "backwardInputDurationUs", "backwardWeightDurationUs", "fullBackwardDurationUs")
    for cold, warm in zip(evicted.layers, profile.layers, strict=True):
        untimed = [json_format.MessageToDict(cost) for cost in (cold, warm)]
        for fields in untimed:
            assert all(fields.pop(name) > 0 for name in timed if name in fields)
        assert untimed[0] == untimed[1]  # only the times may move: every byte figure is the same
    with pytest.raises(ValueError, match="evict_bytes must be >= 0"):
        ProfilerConfig(evict_bytes=-1)


def test_before_sample_runs_once_right_before_every_timed_and_warm_up_sample() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(hidden=32, vocab=128)
    model = nemotron_h("M*", config)
    tokens = torch.randint(0, 128, (2, 8))
    calls: list[int] = []
    profile = profile_layers(
        model, tokens, tokens, config=ProfilerConfig(repeats=3, warmup=2, before_sample=lambda: calls.append(1))
    )
    # four timed graphs per layer (F, B, W, the fused backward), each sampled warm-up + repeats times
    assert len(calls) == len(profile.layers) * 4 * (2 + 3)


def test_weight_gradient_timing_leaves_the_model_and_its_gradients_untouched() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(hidden=32, vocab=128)
    model = nemotron_h("M*", config)
    tokens = torch.randint(0, 128, (2, 8))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    profile_layers(model, tokens, tokens, config=ProfilerConfig(repeats=1, warmup=0))
    # the float32 accumulators W is timed with are the profiler's own: no parameter or .grad changes
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]) and p.grad is None, name
