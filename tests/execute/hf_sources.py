"""Model sources for whole-model runs: transformers models built from configs (random weights, no download).

Each is ``package.module:function`` for a Plan's ``model.source``: called on every rank (and by the
reference) after ``torch.manual_seed(seed)``, it returns ``(model, batch(step) -> (input_ids, labels))``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 96
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _batches(global_batch: int, sequence: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (global_batch, sequence), generator=torch.Generator().manual_seed(100 + step))
        return ids, ids  # HF shifts the labels inside its loss

    return batch


def llama(
    tied: str = "true", layers: str = "3", global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    transformers: Any = importlib.import_module("transformers")  # imported where used: ranks import this module

    config = transformers.LlamaConfig(
        **SMALL, num_hidden_layers=int(layers), tie_word_embeddings=tied == "true", attn_implementation="sdpa"
    )
    return transformers.LlamaForCausalLM(config), _batches(int(global_batch), int(sequence))


def qwen3_moe(
    global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """Qwen3-MoE with its load-balancing loss; deterministic mode, as its own eager expert gradients need."""
    transformers: Any = importlib.import_module("transformers")  # imported where used: ranks import this module

    torch.use_deterministic_algorithms(True)  # index_put accumulation repeats bitwise only here
    config = transformers.Qwen3MoeConfig(
        **SMALL,
        head_dim=8,
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        tie_word_embeddings=False,
        experts_implementation="batched_mm",
    )
    return transformers.Qwen3MoeForCausalLM(config), _batches(int(global_batch), int(sequence))


class TokenGlue(nn.Module):
    """A plain module whose loss reads the token ids again after the last layer.

    So the ids cross every stage boundary beside the hidden states, without a gradient.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        seen = (tokens.unsqueeze(-1) == torch.arange(32)).to(x.dtype)  # glue after the last layer reads the ids
        logits = self.head(x) + 0.5 * seen
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_glue(
    global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """Run with ``capture=whole`` in the reference's config (a plain module defaults to the layer list)."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (int(global_batch), int(sequence))
        tokens = torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(200 + step))
        return tokens, tokens.roll(1, 1)

    return TokenGlue(), batch


def family(
    name: str, attention: str = "sdpa", global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """Any family of tests/hf_models.py (``FAMILIES``) with the given attention kernel; MoE families in
    deterministic mode, as their own eager expert gradients need."""
    models: Any = importlib.import_module("tests.hf_models")  # imported where used: ranks import this module

    if name in models.MOE:
        torch.use_deterministic_algorithms(True)
    return models.FAMILIES[name](attention), _batches(int(global_batch), int(sequence))
