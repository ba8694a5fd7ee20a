"""HuggingFace transformers ``*ForCausalLM`` models as pipeline layers.

The layers are ``model.embed_tokens``, each ``model.layers.<i>`` (which also
uses the shared ``model.rotary_emb`` buffers), ``model.norm`` and ``lm_head``;
the loss is the model's own ``loss_function`` (labels are shifted inside it, as
in ``model(input_ids=..., labels=...)``). Each decoder layer recomputes its
rotary embeddings from positions, and causal masking comes from the attention
kernel (``sdpa``) or an explicit additive mask (``eager``), so no data-dependent
mask-building code runs inside a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from octopipe.capture.types import LayerSpec, PipelineSpec

__all__ = ["hf_causal_lm_spec", "is_hf_causal_lm"]


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` looks like a transformers decoder-only ``*ForCausalLM``."""
    inner = getattr(model, "model", None)
    return (
        hasattr(model, "config")
        and isinstance(getattr(model, "lm_head", None), nn.Module)
        and isinstance(inner, nn.Module)
        and isinstance(getattr(inner, "layers", None), nn.ModuleList)
        and isinstance(getattr(inner, "embed_tokens", None), nn.Module)
    )


@dataclass(frozen=True)
class _Module:
    path: str

    def __call__(self, root: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = root.get_submodule(self.path)(x)
        return out


@dataclass(frozen=True)
class _DecoderLayer:
    path: str
    rotary: str | None
    attention: str

    def __call__(self, root: nn.Module, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        positions = torch.arange(seq, device=x.device).unsqueeze(0).expand(batch, -1)
        kwargs: dict[str, object] = {"position_ids": positions}
        if self.rotary is not None:
            kwargs["position_embeddings"] = root.get_submodule(self.rotary)(x, positions)
        if self.attention != "sdpa":  # sdpa masks causally by itself when given no mask
            mask = torch.full((seq, seq), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
            kwargs["attention_mask"] = mask.view(1, 1, seq, seq)
        out = root.get_submodule(self.path)(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def hf_causal_lm_spec(model: nn.Module) -> PipelineSpec:
    """Layers and loss of a transformers ``*ForCausalLM`` model."""
    if not is_hf_causal_lm(model):
        raise TypeError(f"{type(model).__name__} is not a transformers *ForCausalLM model (model.layers, lm_head)")
    hf: Any = model  # transformers models are untyped here
    config = hf.config
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        raise ValueError(
            f"attention implementation {attention!r} is not supported: build the model with attn_implementation='sdpa' or 'eager'"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "the model ties its input and output embeddings, which would put one parameter in two stages: "
            "build it with tie_word_embeddings=False"
        )
    inner = hf.model
    rotary = "model.rotary_emb" if isinstance(getattr(inner, "rotary_emb", None), nn.Module) else None
    layers = [LayerSpec(name="model.embed_tokens", modules=("model.embed_tokens",), run=_Module("model.embed_tokens"))]
    for index in range(len(inner.layers)):
        path = f"model.layers.{index}"
        modules = (path, rotary) if rotary else (path,)
        layers.append(LayerSpec(name=path, modules=modules, run=_DecoderLayer(path, rotary, attention)))
    layers.append(LayerSpec(name="model.norm", modules=("model.norm",), run=_Module("model.norm")))
    layers.append(LayerSpec(name="lm_head", modules=("lm_head",), run=_Module("lm_head")))
    loss_function = hf.loss_function
    vocab = int(config.vocab_size)

    def loss(root: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = loss_function(logits=logits, labels=labels, vocab_size=vocab)
        return out

    return PipelineSpec(layers=tuple(layers), loss=loss)
