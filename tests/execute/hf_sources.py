"""Model sources for whole-model runs: transformers models built from configs (random weights, no download).

Each is ``package.module:function`` for a Plan's ``model.source``: called on every rank (and by the
reference) after ``torch.manual_seed(seed)``, it returns ``(model, batch(step) -> (input_ids, labels))``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.hf_models import FAMILIES, MOE, SMALL, moe
from tests.hf_models import llama as _llama

VOCAB = SMALL["vocab_size"]


def _batches(global_batch: int, sequence: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (global_batch, sequence), generator=torch.Generator().manual_seed(100 + step))
        return ids, ids  # HF shifts the labels inside its loss

    return batch


def llama(
    tied: str = "true", layers: str = "3", global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    return _llama("sdpa", tied=tied == "true", layers=int(layers)), _batches(int(global_batch), int(sequence))


def qwen3_moe(
    global_batch: str = "4", sequence: str = "8"
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """Qwen3-MoE with its load-balancing loss, untied; deterministic mode, as its own eager expert gradients need."""
    torch.use_deterministic_algorithms(True)  # index_put accumulation repeats bitwise only here
    model = moe("qwen3moe", "sdpa", experts_implementation="batched_mm", tie_word_embeddings=False)
    return model, _batches(int(global_batch), int(sequence))


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
    if name in MOE:
        torch.use_deterministic_algorithms(True)
    return FAMILIES[name](attention), _batches(int(global_batch), int(sequence))
