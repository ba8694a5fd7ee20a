"""Real third-party model code (HuggingFace transformers, random weights, no download) and clear errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from octopipe.capture import CaptureConfig, CaptureError, capture_stage, pipeline_spec, split_model
from octopipe.examples.models import ModelConfig, llama
from tests.pipeline_reference import assert_same, eager_reference, run_split

transformers = pytest.importorskip("transformers")
COMMON = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_splits_and_matches_bitwise(attention: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, num_hidden_layers=3, attn_implementation=attention)
    model = transformers.LlamaForCausalLM(config)
    names = pipeline_spec(model).names
    assert names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    ]
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    loss, grads = eager_reference(model, lambda: model(input_ids=tokens, labels=tokens).loss, seed=0)
    result = run_split(model, [names[:2], names[2:4], names[4:]], tokens, tokens, seed=0)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    first = result.stages[0].graphs
    assert "model.rotary_emb.inv_freq" in first.buffer_names  # buffers are lifted as graph inputs
    assert all(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in first.param_names)


def test_export_first_route_when_direct_capture_fails() -> None:
    """Mixtral's expert kernel rejects direct tracing; torch.export first, then joint capture, works."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)

    class WholeModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.m(input_ids=tokens, labels=labels).loss
            return out

    whole = WholeModel()
    tokens = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CaptureError, match=r"\[direct\] cannot capture stage 0 in module 'm\.model\.layers\.0\.mlp"):
        capture_stage(whole, [tokens, tokens], config=CaptureConfig(route="direct"))
    graphs = capture_stage(whole, [tokens, tokens], config=CaptureConfig(route="auto"))
    assert graphs.route == "export"
    loss, grads = eager_reference(whole, lambda: whole(tokens, tokens), seed=0)
    params = dict(whole.named_parameters())
    (out,), saved = graphs.run_forward(
        [params[n].detach() for n in graphs.param_names],
        [dict(whole.named_buffers())[n] for n in graphs.buffer_names],
        [tokens, tokens],
    )
    torch.testing.assert_close(out, loss)
    param_grads, _ = graphs.run_backward(saved, [torch.ones_like(out)])
    actual = {n: g for n, g in zip(graphs.param_names, param_grads, strict=True) if g is not None}
    assert_same(grads, actual, bitwise=False)


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inner(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum().item() > 0 else -x  # data-dependent Python branch


def test_unsupported_model_names_the_module_and_what_to_change() -> None:
    with pytest.raises(CaptureError) as info:
        capture_stage(ValueBranch(), [torch.randn(2, 4)])
    message = str(info.value)
    assert "in module 'gate'" in message
    assert "_local_scalar_dense" in message
    assert "make it depend on shapes only" in message
    assert "[direct]" in message and "[export]" in message


def test_split_checks_the_partition() -> None:
    model = llama(2, ModelConfig.tiny())
    with pytest.raises(ValueError, match=r"missing layers \['head'\]"):
        split_model(model, [["embed", "layers.0"], ["layers.1"]])
    with pytest.raises(ValueError, match="layers out of order"):
        split_model(model, [["embed", "layers.1"], ["layers.0", "head"]])
    with pytest.raises(ValueError, match=r"unknown layers \['layers.7'\]"):
        split_model(model, [["embed", "layers.7"], ["layers.0", "layers.1", "head"]])
    with pytest.raises(ValueError, match="stage 1 has no layers"):
        split_model(model, [["embed", "layers.0", "layers.1", "head"], []])


def test_stage_keeps_original_names_and_shares_parameters() -> None:
    model = llama(2, ModelConfig.tiny())
    first, second = split_model(model, [["embed", "layers.0"], ["layers.1", "head"]])
    original = dict(model.named_parameters())
    for stage in (first, second):
        for name, param in stage.named_parameters():
            assert param is original[name]
    assert {n.split(".")[0] for n, _ in second.named_parameters()} == {"layers", "head"}
    with pytest.raises(ValueError, match="call it with \\(activations, target\\)"):
        second(torch.zeros(1, 4, 32))


def test_tied_weights_across_stages_are_refused() -> None:
    model = llama(2, ModelConfig.tiny())
    model.head.proj.weight = model.embed.weight
    with pytest.raises(ValueError, match=re.escape("parameter 'head.proj.weight' is used by stage 0 and stage 1")):
        split_model(model, [["embed", "layers.0"], ["layers.1", "head"]])


def test_models_without_a_layer_order_get_told_what_to_do() -> None:
    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="give layers=\\[module names in execution order\\]"):
        pipeline_spec(Opaque())
    sequential = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(TypeError, match="pass loss=fn"):
        pipeline_spec(sequential)
    mse = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    assert pipeline_spec(sequential, loss=mse).names == ["0", "1", "2"]
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    loss, grads = eager_reference(sequential, lambda: mse(sequential(x), y), seed=0)
    result = run_split(sequential, [["0", "1"], ["2"]], x, y, seed=0, loss=mse)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    assert result.input_grads[0] is not None  # a float input gets its gradient
