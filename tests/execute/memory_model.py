"""A model whose memory is computable by hand: bias-free linear layers, a linear loss (tests/execute/test_memory.py)."""

from __future__ import annotations

import torch
from torch import nn


class LinearStack(nn.Module):
    """``layers`` bias-free ``width x width`` linear layers; loss ``mean(output * target)``."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def pipeline_layers(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output * target).mean()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(x, target)


def linear_stack(layers: str = "4", width: str = "16", rows: str = "8192") -> tuple[nn.Module, object]:
    """A plan's model source (``tests.execute.memory_model:linear_stack``): the model and its batches."""
    model = LinearStack(int(layers), int(width))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        shape = (int(rows), int(width))
        return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)

    return model, batch
