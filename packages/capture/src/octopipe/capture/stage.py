"""Splitting a model into pipeline stages.

A stage is an ``nn.Module`` that holds exactly the modules its layers use,
under their original names (``layers.3.mixer.wqkv.weight`` stays that), and
runs its layers in order. The first stage takes the model's input (token ids),
the last one also takes the target and returns the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from octopipe.capture.spec import pipeline_spec
from octopipe.capture.types import LayerSpec, LossFn, PipelineSpec

__all__ = ["StageModule", "split_model"]


class _Container(nn.Module):
    """An empty module that keeps attached submodules under their original dotted names."""


class StageModule(nn.Module):
    """One pipeline stage of a model."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[LayerSpec],
        *,
        stage_index: int,
        num_stages: int,
        loss: LossFn | None,
    ) -> None:
        super().__init__()
        if not layers:
            raise ValueError(f"stage {stage_index} has no layers: give every stage at least one layer")
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_names = tuple(layer.name for layer in layers)
        self._runs = tuple(layer.run for layer in layers)
        self._loss = loss
        self._region: Callable[[int], contextlib.AbstractContextManager[None]] | None = None
        for path in dict.fromkeys(p for layer in layers for p in layer.modules):
            self._attach(model, path)

    def _attach(self, model: nn.Module, path: str) -> None:
        parts = path.split(".")
        parent: nn.Module = self
        for part in parts[:-1]:
            child = parent._modules.get(part)
            if child is None:
                child = _Container()
                parent.add_module(part, child)
            elif not isinstance(child, _Container):
                return  # an enclosing module is attached whole already
            parent = child
        existing = parent._modules.get(parts[-1])
        if existing is None or isinstance(existing, _Container):
            # a container made for inner paths is replaced by the real module, which holds them
            parent._modules[parts[-1]] = model.get_submodule(path)

    @contextlib.contextmanager
    def layer_regions(self, region: Callable[[int], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
        """Inside, the forward runs the stage's i-th layer within ``region(i)`` (capture marks each layer)."""
        self._region = region
        try:
            yield
        finally:
            self._region = None

    def replace_loss(self, loss: LossFn) -> None:
        """Compute the last stage's loss with ``loss(stage, output, target)`` instead (tensor parallelism's
        vocabulary-parallel cross-entropy: the same value from a split head). Only the last stage has a loss."""
        if self._loss is None:
            raise ValueError(f"stage {self.stage_index} is not the last stage: it has no loss to replace")
        self._loss = loss

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        for i, run in enumerate(self._runs):
            if self._region is None:
                x = run(self, x)
            else:
                with self._region(i):
                    x = run(self, x)
        if self._loss is None:
            return x
        if target is None:
            raise ValueError(f"stage {self.stage_index} is the last stage: call it with (activations, target)")
        return self._loss(self, x, target)


def split_model(
    model: nn.Module,
    partition: Sequence[Sequence[str]],
    *,
    layers: Sequence[str] | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    spec: PipelineSpec | None = None,
) -> list[StageModule]:
    """Cut ``model`` into stages: ``partition[s]`` lists stage s's layer names, in order.

    Together the stages must hold every layer once, in the model's order, so
    the first stage has the embedding and the last one the head (and the loss).
    The stages share parameter tensors with ``model``.
    """
    spec = spec or pipeline_spec(model, layers=layers, loss=loss)
    order = spec.names
    flat = [name for stage in partition for name in stage]
    if flat != order:
        unknown = sorted(set(flat) - set(order))
        missing = [n for n in order if n not in flat]
        detail = (
            f"unknown layers {unknown}"
            if unknown
            else f"missing layers {missing}"
            if missing
            else "layers out of order"
        )
        raise ValueError(
            f"the partition must list every layer once, in model order ({order[0]} ... {order[-1]}): {detail}"
        )
    by_name = {layer.name: layer for layer in spec.layers}
    stages = [
        StageModule(
            model,
            [by_name[n] for n in names],
            stage_index=s,
            num_stages=len(partition),
            loss=spec.loss if s == len(partition) - 1 else None,
        )
        for s, names in enumerate(partition)
    ]
    owner: dict[int, tuple[int, str]] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            previous = owner.setdefault(id(param), (stage.stage_index, name))
            if previous[0] != stage.stage_index:
                raise ValueError(
                    f"parameter {name!r} is used by stage {previous[0]} and stage {stage.stage_index} "
                    "(tied weights?): a parameter must live in one stage; untie it or keep its users in one stage"
                )
    return stages
