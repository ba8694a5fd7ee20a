"""The data types capture passes around."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CaptureError", "LayerSpec", "LossFn", "PipelineSpec"]

#: ``loss(stage_root, output, target) -> scalar``
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class CaptureError(RuntimeError):
    """A stage could not be captured; the message names the module or op and what to change."""


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline layer.

    ``name`` is the layer's name in a Plan's partition, ``modules`` the module
    paths whose parameters and buffers it uses (they keep their names in the
    stage), and ``run(stage_root, x)`` computes the layer's output tensor.
    """

    name: str
    modules: tuple[str, ...]
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineSpec:
    """A model as an ordered sequence of layers and a loss."""

    layers: tuple[LayerSpec, ...]
    loss: LossFn

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]
