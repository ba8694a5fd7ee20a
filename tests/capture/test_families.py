"""More transformers families, whole-model captured and split: bitwise loss and every gradient, or a clear refusal.

Gemma3 (scaled embeddings, sliding-window layers), GPT2 (``transformer.h``, tied ``wte``),
FalconH1 (hybrid Mamba/attention, non-1.0 multipliers), DeepseekV3 (MLA + MoE), all built
from configs with random weights. Deterministic mode: MoE expert gradients accumulate with
index_put, which repeats bitwise run to run only there (the reference runs under it too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from octopipe.capture import trace_model
from tests.capture.whole_model import assert_bitwise, model_reference, run_graph_split

transformers = pytest.importorskip("transformers")
SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def gemma3(attention: str) -> Any:
    layer_types = ["sliding_attention", "full_attention"] * 2
    config = transformers.Gemma3TextConfig(
        **SMALL,
        head_dim=8,
        num_hidden_layers=4,
        sliding_window=4,
        layer_types=layer_types,
        attn_implementation=attention,
    )
    return transformers.Gemma3ForCausalLM(config)


def gpt2(attention: str) -> Any:
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=16, attn_implementation=attention
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


def falcon_h1(attention: str) -> Any:
    config = transformers.FalconH1Config(
        **SMALL,
        head_dim=8,
        num_hidden_layers=3,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=8,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        attn_implementation=attention,
    )
    return transformers.FalconH1ForCausalLM(config)


def deepseek_v3(attention: str) -> Any:
    config = transformers.DeepseekV3Config(
        **SMALL,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        attn_implementation=attention,
        experts_implementation="batched_mm",
    )
    return transformers.DeepseekV3ForCausalLM(config)


FAMILIES: dict[str, Callable[[str], Any]] = {
    "gemma3": gemma3,
    "gpt2": gpt2,
    "falcon_h1": falcon_h1,
    "deepseek_v3": deepseek_v3,
}
#: eager attention is the same split of another kernel: those variants run with ./scripts/test.sh --all
EXTENDED = pytest.mark.extended
CASES = [
    ("gemma3", "sdpa"),
    pytest.param("gemma3", "eager", marks=EXTENDED),
    ("gpt2", "sdpa"),
    pytest.param(
        "gpt2",
        "eager",
        marks=pytest.mark.xfail(
            strict=True,
            reason="loss bitwise, but a few early gradients differ in the last bits from the model's own backward "
            "(the recorded graph's autograd accumulation order differs); not understood yet",
        ),
    ),
    ("falcon_h1", "sdpa"),
    pytest.param("falcon_h1", "eager", marks=EXTENDED),
    ("deepseek_v3", "sdpa"),
]


@pytest.fixture
def deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize(("family", "attention"), CASES)
def test_family_two_and_three_stages_bitwise(family: str, attention: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family](attention)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    names = list(graph.layers)
    for partition, fused in (
        ([names[: len(names) // 2], names[len(names) // 2 :]], False),
        ([names[:2], names[2:4], names[4:]], True),
    ):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)


def test_gpt2_layers_follow_its_own_module_layout() -> None:
    graph = trace_model(
        gpt2("sdpa"), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    )
    assert graph.layers == (
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
        "lm_head",
    )
