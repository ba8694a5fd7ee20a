"""transformers families built from small configs (random weights, no download), shared by the capture tests
and the 2-rank runs (tests/execute/hf_sources.py). Imported where used: ranks import it too."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SMALL: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
#: families whose experts' gradients accumulate with index_put: bitwise run to run only in deterministic mode
MOE = ("qwen3moe", "olmoe", "deepseek_v3")


def _transformers() -> Any:
    return importlib.import_module("transformers")


def llama(attention: str, tied: bool = True, layers: int = 3) -> Any:
    t = _transformers()
    config = t.LlamaConfig(**SMALL, num_hidden_layers=layers, attn_implementation=attention, tie_word_embeddings=tied)
    return t.LlamaForCausalLM(config)


def qwen3(attention: str) -> Any:
    t = _transformers()
    config = t.Qwen3Config(
        **SMALL, head_dim=8, num_hidden_layers=4, tie_word_embeddings=True, attn_implementation=attention
    )
    return t.Qwen3ForCausalLM(config)


def moe(family: str, attention: str = "sdpa", **extra: object) -> Any:
    """Qwen3-MoE or OLMoE with ``output_router_logits=True`` (their load-balancing loss in the loss)."""
    t = _transformers()
    common: dict[str, object] = {**SMALL, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2}
    common.update({"output_router_logits": True, "router_aux_loss_coef": 0.1, "attn_implementation": attention})
    common.update(extra)
    if family == "qwen3moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=32))
    return t.OlmoeForCausalLM(t.OlmoeConfig(**common))


def gemma3(attention: str) -> Any:
    t = _transformers()
    config = t.Gemma3TextConfig(
        **SMALL,
        head_dim=8,
        num_hidden_layers=4,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_implementation=attention,
    )
    return t.Gemma3ForCausalLM(config)


def gpt2(attention: str) -> Any:
    t = _transformers()
    config = t.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=16, attn_implementation=attention)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return t.GPT2LMHeadModel(config)


def falcon_h1(attention: str) -> Any:
    t = _transformers()
    config = t.FalconH1Config(
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
    return t.FalconH1ForCausalLM(config)


def deepseek_v3(attention: str) -> Any:
    t = _transformers()
    # MLA has as many key/value heads as query heads (DeepSeek-V3: 128 and 128); its eager attention
    # (no repeat_kv) fails with fewer
    config = t.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": SMALL["num_attention_heads"]},
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
    return t.DeepseekV3ForCausalLM(config)


#: family -> builder(attention) for every family the tests run
FAMILIES: dict[str, Callable[[str], Any]] = {
    "llama_tied": lambda attention: llama(attention, tied=True),
    "llama_untied": lambda attention: llama(attention, tied=False),
    "qwen3": qwen3,
    "qwen3moe": lambda attention: moe("qwen3moe", attention, experts_implementation="batched_mm"),
    "olmoe": lambda attention: moe("olmoe", attention, experts_implementation="batched_mm"),
    "gemma3": gemma3,
    "gpt2": gpt2,
    "falcon_h1": falcon_h1,
    "deepseek_v3": deepseek_v3,
}
