"""Whole-model capture split at layer boundaries: loss and every gradient bitwise equal to the model's own run.

The reference is always the model's own eager ``model(**inputs)`` (for HuggingFace
models ``model(input_ids=..., labels=...)``) and ``loss.backward()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from octopipe.capture import CaptureError, split_graph, tied_parameters, trace_model
from octopipe.examples.models import ModelConfig, llama
from tests.capture.whole_model import assert_bitwise, model_reference, run_graph_split

transformers = pytest.importorskip("transformers")
SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def hf_inputs(vocab: int = 96, seq: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def thirds(names: tuple[str, ...]) -> list[list[str]]:
    third = max(1, len(names) // 3)
    return [list(names[:third]), list(names[third : 2 * third]), list(names[2 * third :])]


def halves(names: tuple[str, ...]) -> list[list[str]]:
    return [list(names[: len(names) // 2]), list(names[len(names) // 2 :])]


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("eager", marks=pytest.mark.extended)])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_llama_whole_model_bitwise(attention: str, tied: bool) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SMALL, num_hidden_layers=3, attn_implementation=attention, tie_word_embeddings=tied
    )
    model = transformers.LlamaForCausalLM(config)
    inputs = hf_inputs()
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    assert graph.layers == (
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    )
    for partition, fused in ((halves(graph.layers), False), (thirds(graph.layers), True)):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)
        # rotary tables and masks depend only on shapes: each stage recomputes them, only hidden states cross
        assert all(len(stage.output_names) == 1 for stage in result.stages)
    tied_found = tied_parameters(result.stages)
    if tied:
        assert [(t.name, t.stages) for t in tied_found] == [("model.embed_tokens.weight", (0, 2))]
    else:
        assert tied_found == []


def test_hf_qwen3_three_stages_split_and_fused() -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**SMALL, head_dim=8, num_hidden_layers=4, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    inputs = hf_inputs()
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    for fused in (False, True):
        result = run_graph_split(graph, thirds(graph.layers), inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)


def test_zoo_model_with_layer_hints() -> None:
    """``pipeline_layers()`` names the layers; the model's own ``forward(tokens, targets)`` is captured."""
    torch.manual_seed(0)
    config = ModelConfig.tiny()
    model = llama(3, config)
    tokens = torch.randint(0, config.vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    assert graph.layers == tuple(model.pipeline_layers()) and graph.target_names == ("targets",)
    for partition, fused in ((halves(graph.layers), False), (thirds(graph.layers), True)):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)


class Scaled(nn.Module):
    """A plain module with no hints: glue between its layers (a multiplier, a z-loss) must not be lost."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 32)
        self.scale = 4.0

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x) / self.scale
        z_loss = 1e-3 * logits.logsumexp(-1).pow(2).mean()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + z_loss


def test_plain_module_layers_discovered_and_glue_kept() -> None:
    torch.manual_seed(0)
    model = Scaled()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"tokens": tokens, "targets": tokens.roll(1, 1)}
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    assert graph.layers == ("embed", "blocks.0", "blocks.1", "blocks.2", "head")
    for partition, fused in (
        ([["embed", "blocks.0"], ["blocks.1", "blocks.2", "head"]], False),
        (thirds(graph.layers), True),
    ):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)


def test_tied_parameters_need_explicit_consent() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, num_hidden_layers=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    graph = trace_model(model, hf_inputs())
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is used by stages \[0, 1\].*allow_tied=True"):
        split_graph(graph, halves(graph.layers))
    (whole,) = split_graph(graph, [list(graph.layers)])  # in one stage the tie needs nothing
    assert tied_parameters([whole]) == []


class ValueLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.gate = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        scores = self.gate(x)
        for index in scores.argmax(-1).unique():  # a loop over the values the data takes
            x = x + index
        return F.mse_loss(x.mean(-1), targets.float())


def test_data_dependent_code_is_refused_with_the_module_named() -> None:
    tokens = torch.randint(0, 16, (2, 4))
    with pytest.raises(CaptureError, match=r"reads tensor values that depend on the inputs or parameters"):
        trace_model(ValueLoop(), {"tokens": tokens, "targets": tokens})


def test_partition_and_layer_errors_say_what_to_change() -> None:
    model = Scaled()
    tokens = torch.randint(0, 32, (2, 8))
    graph = trace_model(model, {"tokens": tokens, "targets": tokens})
    with pytest.raises(ValueError, match=r"missing layers \['head'\]"):
        split_graph(graph, [["embed", "blocks.0"], ["blocks.1", "blocks.2"]])
    with pytest.raises(ValueError, match="stage 1 has no layers"):
        split_graph(graph, [list(graph.layers), []])
    with pytest.raises(ValueError, match=r"layers \['nope'\] are not modules of Scaled"):
        trace_model(model, {"tokens": tokens, "targets": tokens}, layers=["embed", "nope"])
    with pytest.raises(ValueError, match=r"targets \['labels'\] are not among the inputs"):
        trace_model(model, {"tokens": tokens, "targets": tokens}, targets=["labels"])


@pytest.fixture
def deterministic() -> Iterator[None]:
    """MoE expert gradients accumulate with index_put: eager itself repeats bitwise only in deterministic mode."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def moe_model(family: str, **extra: object) -> Any:
    common: dict[str, object] = {**SMALL, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2}
    common.update({"output_router_logits": True, "router_aux_loss_coef": 0.1, **extra})
    if family == "qwen3moe":
        return transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=32)
        )
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common))


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("family", ["qwen3moe", "olmoe"])
def test_moe_auxiliary_loss_reaches_the_last_stage_bitwise(family: str) -> None:
    """``output_router_logits=True``: every layer's router logits cross to the last stage, into the aux loss."""
    torch.manual_seed(0)
    model = moe_model(family, experts_implementation="batched_mm")
    inputs = {"input_ids": hf_inputs()["input_ids"], "labels": hf_inputs(seq=8)["labels"].roll(1, 1)}
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    for partition, fused in ((halves(graph.layers), False), (thirds(graph.layers), True)):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)
    # three stages: layer 0's router logits enter stage 1, and all three layers' reach the last stage
    crossing = [len(stage.output_names) for stage in result.stages]
    assert crossing == [2, 4, 1]
    model.config.output_router_logits = False  # the aux loss is really in the loss the stages computed
    plain, _ = model_reference(model, inputs)
    assert not torch.equal(plain, loss)


def test_moe_grouped_mm_refused_with_what_to_change() -> None:
    """transformers' default grouped_mm experts have no fp32 CPU tracing kernel: refused, told what to set."""
    torch.manual_seed(0)
    model = moe_model("qwen3moe")
    inputs = hf_inputs()
    graph = trace_model(model, inputs)
    with pytest.raises(CaptureError, match="experts_implementation='batched_mm'"):
        run_graph_split(graph, halves(graph.layers), inputs, fused=False)
