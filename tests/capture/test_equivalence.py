"""Every stage's F, then B, then W reproduce eager autograd: loss, input gradients, every parameter gradient.

Bitwise: the graphs run the same ATen ops as eager autograd, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from octopipe.capture import CaptureConfig
from octopipe.examples.models import DecoderLM, ModelConfig, jamba, llama, moe_decoder, nemotron_h
from tests.pipeline_reference import assert_same, eager_reference, run_split

SEQ = 8
ZOO: dict[str, Callable[[ModelConfig], DecoderLM]] = {
    "llama": lambda c: llama(3, c),
    "moe": lambda c: moe_decoder(3, c),
    "mamba": lambda c: DecoderLM([("mamba", "none"), ("mamba", "swiglu")], c),
    "jamba": lambda c: jamba(6, c),
    "nemotron-h": lambda c: nemotron_h("M-*EM", c),
}


def three_stages(model: DecoderLM) -> list[list[str]]:
    names = model.pipeline_layers()
    third = max(1, len(names) // 3)
    return [names[:third], names[third : 2 * third], names[2 * third :]]


def batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("fused", [False, True], ids=["B+W", "fused"])
def test_zoo_stages_equal_eager_bitwise(name: str, fused: bool) -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny()
    model = ZOO[name](config)
    tokens, targets = batch(config.vocab)
    loss, grads = eager_reference(model, lambda: model(tokens, targets), seed=3)
    result = run_split(model, three_stages(model), tokens, targets, seed=3, fused=fused)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    assert result.input_grads == [None]  # token ids get no gradient


def test_dropout_same_seed_same_numbers_same_rng_use() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(dropout=0.25)
    model = llama(3, config)
    tokens, targets = batch(config.vocab)
    loss, grads = eager_reference(model, lambda: model(tokens, targets), seed=11)
    eager_rng = torch.get_rng_state()
    result = run_split(model, three_stages(model), tokens, targets, seed=11)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    # the backward draws no random numbers, exactly like eager autograd
    assert torch.equal(torch.get_rng_state(), eager_rng)
    # ... and the masks really were random: another seed gives another loss
    other = run_split(model, three_stages(model), tokens, targets, seed=12)
    assert not torch.equal(other.loss, loss)


def test_dropout_recomputed_in_backward_is_pruned() -> None:
    torch.manual_seed(0)
    config = ModelConfig.tiny(dropout=0.25)
    model = llama(3, config)
    tokens, targets = batch(config.vocab)
    result = run_split(model, three_stages(model), tokens, targets, seed=1)
    pruned = [n for exe in result.stages for n in exe.graphs.pruned_nodes]
    backward_ops = [str(n.target) for exe in result.stages for n in exe.graphs.backward.graph.nodes]
    assert not any("dropout" in op and "backward" not in op for op in backward_ops)
    assert any("flash_attention" in op or "dropout" in op for op in pruned)


def test_activation_checkpointing_recomputes_and_matches() -> None:
    torch.manual_seed(0)
    plain = llama(3, ModelConfig.tiny())
    torch.manual_seed(0)
    checkpointed = llama(3, ModelConfig.tiny(checkpoint=True))
    tokens, targets = batch(64)
    loss, grads = eager_reference(checkpointed, lambda: checkpointed(tokens, targets), seed=2)
    result = run_split(checkpointed, three_stages(checkpointed), tokens, targets, seed=2)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    baseline = run_split(plain, three_stages(plain), tokens, targets, seed=2)
    partition = three_stages(checkpointed)
    for names, exe, base in zip(partition, result.stages, baseline.stages, strict=True):
        if not any(n.startswith("layers.") for n in names):
            assert exe.graphs.recompute_regions == 0
            continue
        assert exe.graphs.recompute_regions == sum(n.startswith("layers.") for n in names)
        assert exe.graphs.num_saved < base.graphs.num_saved  # fewer activations kept
        forward_ops = {str(n.target) for n in exe.graphs.forward.graph.nodes if n.op == "call_function"}
        backward_ops = {str(n.target) for n in exe.graphs.backward.graph.nodes if n.op == "call_function"}
        assert forward_ops & backward_ops & {"aten.mm.default", "aten.addmm.default", "aten.silu.default"}


def test_min_cut_partitioner_also_matches() -> None:
    torch.manual_seed(0)
    model = jamba(4, ModelConfig.tiny())
    tokens, targets = batch(64)
    loss, grads = eager_reference(model, lambda: model(tokens, targets), seed=0)
    result = run_split(model, three_stages(model), tokens, targets, seed=0, config=CaptureConfig(partitioner="min_cut"))
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)


def test_single_stage_is_the_whole_model() -> None:
    torch.manual_seed(0)
    model = moe_decoder(2, ModelConfig.tiny())
    tokens, targets = batch(64)
    loss, grads = eager_reference(model, lambda: model(tokens, targets), seed=0)
    result = run_split(model, [model.pipeline_layers()], tokens, targets, seed=0)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
