"""Decoder language models built from layer kinds, and the zoo's builders.

Every model is ``embed -> layers.0 .. layers.{n-1} -> head`` plus a
cross-entropy loss, with the layers in an ``nn.ModuleList`` so their names
(``layers.3``) survive a split into pipeline stages. ``pipeline_layers()`` and
``pipeline_loss()`` tell octopipe.capture the layer order and the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from octopipe.examples.models.blocks import Attention, SquaredReluMLP, SwiGLU
from octopipe.examples.models.mamba import Mamba
from octopipe.examples.models.moe import MoE

__all__ = [
    "NEMOTRON_H_8B",
    "NEMOTRON_H_56B",
    "Block",
    "DecoderLM",
    "Head",
    "ModelConfig",
    "jamba",
    "jamba_kinds",
    "llama",
    "moe_decoder",
    "nemotron_h",
    "nemotron_h_kinds",
]

MIXERS = ("attention", "mamba", "mamba2", "none")
FFNS = ("swiglu", "relu2", "moe", "none")

NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_56B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Sizes of a zoo model. The defaults are shared/benchmarks.md's standard workloads."""

    vocab: int = 8192
    hidden: int = 256
    heads: int = 8
    ffn: int = 688
    mlp_ffn: int = 1024
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 2.0
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    mamba_heads: int = 8
    dropout: float = 0.0
    checkpoint: bool = False

    @classmethod
    def tiny(cls, **changes: object) -> ModelConfig:
        """Sizes for unit tests: a step in milliseconds."""
        base = cls(vocab=64, hidden=32, heads=4, ffn=48, mlp_ffn=64, experts=4, d_state=4, mamba_heads=4)
        return replace(base, **changes)  # type: ignore[arg-type]


class Block(nn.Module):
    """One decoder layer: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` (either may be absent)."""

    def __init__(self, mixer: str, ffn: str, config: ModelConfig) -> None:
        super().__init__()
        if mixer not in MIXERS or ffn not in FFNS or (mixer, ffn) == ("none", "none"):
            raise ValueError(
                f"unknown layer kind ({mixer!r}, {ffn!r}): mixer in {MIXERS}, ffn in {FFNS}, not both 'none'"
            )
        self.kind = "+".join(k for k in (mixer, ffn) if k != "none")
        self.use_checkpoint = config.checkpoint
        self.dropout = config.dropout
        c = config
        self.mixer_norm = nn.RMSNorm(c.hidden) if mixer != "none" else None
        self.mixer: nn.Module | None = {
            "attention": lambda: Attention(c.hidden, c.heads, dropout=c.dropout),
            "mamba": lambda: Mamba(c.hidden, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand),
            "mamba2": lambda: Mamba(c.hidden, d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, heads=c.mamba_heads),
            "none": lambda: None,
        }[mixer]()
        self.ffn_norm = nn.RMSNorm(c.hidden) if ffn != "none" else None
        self.ffn: nn.Module | None = {
            "swiglu": lambda: SwiGLU(c.hidden, c.ffn),
            "relu2": lambda: SquaredReluMLP(c.hidden, c.mlp_ffn),
            "moe": lambda: MoE(c.hidden, c.ffn, experts=c.experts, top_k=c.top_k, capacity_factor=c.capacity_factor),
            "none": lambda: None,
        }[ffn]()

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        if self.mixer is not None and self.mixer_norm is not None:
            x = x + F.dropout(self.mixer(self.mixer_norm(x)), self.dropout, self.training)
        if self.ffn is not None and self.ffn_norm is not None:
            x = x + F.dropout(self.ffn(self.ffn_norm(x)), self.dropout, self.training)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_checkpoint:
            out: torch.Tensor = checkpoint(self._body, x, use_reentrant=False)
            return out
        return self._body(x)


class Head(nn.Module):
    """Final norm and output projection to vocabulary logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.hidden)
        self.proj = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class DecoderLM(nn.Module):
    """``embed -> layers -> head``; ``forward(tokens, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, kinds: Sequence[tuple[str, str]], config: ModelConfig) -> None:
        super().__init__()
        if not kinds:
            raise ValueError("a model needs at least one layer")
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(Block(mixer, ffn, config) for mixer, ffn in kinds)
        self.head = Head(config)

    def pipeline_layers(self) -> list[str]:
        """Module names in execution order; each maps one tensor to the next."""
        return ["embed", *[f"layers.{i}" for i in range(len(self.layers))], "head"]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy (no parameters)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def layer_kind(self, name: str) -> str:
        """``embedding``, ``head``, or a block's kind such as ``mamba+moe``."""
        if name in ("embed", "head"):
            return {"embed": "embedding", "head": "head"}[name]
        block = self.get_submodule(name)
        assert isinstance(block, Block)
        return block.kind

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(self.head(x), targets)


def llama(num_layers: int, config: ModelConfig | None = None) -> DecoderLM:
    """Llama-style: attention + SwiGLU in every layer."""
    return DecoderLM([("attention", "swiglu")] * num_layers, config or ModelConfig())


def moe_decoder(num_layers: int, config: ModelConfig | None = None) -> DecoderLM:
    """Mixtral-style: attention + MoE in every layer."""
    return DecoderLM([("attention", "moe")] * num_layers, config or ModelConfig())


def jamba_kinds(num_layers: int) -> list[tuple[str, str]]:
    """Jamba's pattern: attention if i % 8 == 4 else Mamba; MoE FFN if i % 2 == 1 else dense."""
    return [("attention" if i % 8 == 4 else "mamba", "moe" if i % 2 == 1 else "swiglu") for i in range(num_layers)]


def jamba(num_layers: int, config: ModelConfig | None = None) -> DecoderLM:
    return DecoderLM(jamba_kinds(num_layers), config or ModelConfig())


def nemotron_h_kinds(pattern: str) -> list[tuple[str, str]]:
    """Nemotron-H's pattern string: ``M`` Mamba-2, ``*`` attention, ``-`` squared-ReLU MLP, ``E`` MoE."""
    table = {"M": ("mamba2", "none"), "*": ("attention", "none"), "-": ("none", "relu2"), "E": ("none", "moe")}
    unknown = sorted(set(pattern) - set(table))
    if unknown or not pattern:
        raise ValueError(f"pattern {pattern!r}: use only the letters M, *, - and E (unknown: {unknown})")
    return [table[ch] for ch in pattern]


def nemotron_h(pattern: str, config: ModelConfig | None = None) -> DecoderLM:
    return DecoderLM(nemotron_h_kinds(pattern), config or ModelConfig())
