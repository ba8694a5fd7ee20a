"""How a model is cut into layers: an ordered list of layers and a loss.

A model tells octopipe its layer order in one of three ways, tried in order:
1. a ``pipeline_layers()`` method returning module names in execution order,
   each module mapping one tensor to the next, and ``pipeline_loss(out, target)``
   (the zoo's models do this);
2. a HuggingFace ``*ForCausalLM`` model (see ``octopipe.capture.hf``);
3. an ``nn.Sequential``, whose children are the layers, with ``loss=`` given.
Anything else: pass ``layers=[...]`` and ``loss=...`` explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture.hf import hf_causal_lm_spec, is_hf_causal_lm
from octopipe.capture.types import LayerSpec, LossFn, PipelineSpec

__all__ = ["LayerSpec", "PipelineSpec", "pipeline_spec"]


@dataclass(frozen=True)
class _CallModule:
    """Run the module at ``path`` of the stage root on the running tensor."""

    path: str

    def __call__(self, root: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = root.get_submodule(self.path)(x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"layer {self.path!r} returned {type(out).__name__}; a pipeline layer must return one tensor "
                "(wrap it, or describe the model with pipeline_spec())"
            )
        return out


def _loss_from(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    def loss(root: nn.Module, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fn(out, target)

    return loss


def pipeline_spec(
    model: nn.Module,
    *,
    layers: Sequence[str] | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> PipelineSpec:
    """The model's layers in execution order and its loss."""
    if layers is None and loss is None and is_hf_causal_lm(model):
        return hf_causal_lm_spec(model)
    names: Sequence[str]
    if layers is not None:
        names = layers
    elif callable(getattr(model, "pipeline_layers", None)):
        names = model.pipeline_layers()  # type: ignore[operator]
    elif isinstance(model, nn.Sequential):
        names = [name for name, _ in model.named_children()]
    else:
        raise TypeError(
            f"octopipe cannot tell the layer order of {type(model).__name__}: give layers=[module names in "
            "execution order] and loss=fn(output, target), or add pipeline_layers()/pipeline_loss() methods"
        )
    loss_fn = loss if loss is not None else getattr(model, "pipeline_loss", None)
    if not callable(loss_fn):
        raise TypeError(f"{type(model).__name__} has no pipeline_loss(): pass loss=fn(output, target)")
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known or n == ""]
    if missing:
        raise ValueError(
            f"layers {missing} are not modules of {type(model).__name__}; known names include {sorted(known)[:8]}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"layer names repeat: {list(names)}")
    specs = tuple(LayerSpec(name=n, modules=(n,), run=_CallModule(n)) for n in names)
    return PipelineSpec(layers=specs, loss=_loss_from(loss_fn))
