"""Building the model a Plan names, the same way on every rank.

A ``ModelReference`` with ``source = "octopipe.examples:workload"`` names one of
shared/benchmarks.md's workloads (``name``); its ``config`` may override the
workload's sizes (``tiny``, ``sequence``, ``global_batch``, and any
``ModelConfig`` field such as ``hidden`` or ``dropout``). Any other source is
``package.module:function``: the function is called with the config as keyword
arguments (strings) and must return ``(model, batch_fn)``, where
``batch_fn(step) -> (inputs, targets)`` gives the global batch of a step.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.plan.v1 import plan_pb2

__all__ = ["BuiltModel", "build_model", "workload_reference"]

WORKLOAD_SOURCE = "octopipe.examples:workload"


@dataclass(frozen=True, eq=False)
class BuiltModel:
    model: nn.Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def workload_reference(name: str, **config: object) -> plan_pb2.ModelReference:
    """A ModelReference for a standard workload, with config overrides."""
    reference = plan_pb2.ModelReference(name=name, source=WORKLOAD_SOURCE)
    for key, value in config.items():
        reference.config[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return reference


def _parse(value: str, like: object) -> object:
    if isinstance(like, bool):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() == "true"
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    return value


def _build_workload(reference: plan_pb2.ModelReference, seed: int) -> BuiltModel:
    from octopipe.examples import ModelConfig, workload  # noqa: PLC0415

    base = workload(reference.name)
    config = dict(reference.config)
    model_config = ModelConfig.tiny() if config.pop("tiny", "false").lower() == "true" else base.config
    changes: dict[str, object] = {}
    for key in ("sequence", "global_batch", "microbatches"):
        if key in config:
            changes[key] = int(config.pop(key))
    fields = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    overrides = {}
    for key, value in config.items():
        if key not in fields:
            raise ValueError(
                f"model config key {key!r} is unknown: use tiny, sequence, global_batch or one of {sorted(fields)}"
            )
        overrides[key] = _parse(value, fields[key])
    chosen = dataclasses.replace(base, config=dataclasses.replace(model_config, **overrides), **changes)  # type: ignore[arg-type]
    model = chosen.model(seed=seed)
    return BuiltModel(model=model, batch=lambda step: chosen.batch(seed=seed + step))


def build_model(reference: plan_pb2.ModelReference, *, seed: int = 0) -> BuiltModel:
    """The model and its data for ``reference``; identical on every rank for the same seed."""
    if reference.source == WORKLOAD_SOURCE:
        return _build_workload(reference, seed)
    module_name, _, function_name = reference.source.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"model source {reference.source!r}: use 'package.module:function' or {WORKLOAD_SOURCE!r}")
    function = getattr(importlib.import_module(module_name), function_name)
    torch.manual_seed(seed)
    model, batch = function(**dict(reference.config))
    if not isinstance(model, nn.Module) or not callable(batch):
        raise TypeError(f"{reference.source} must return (nn.Module, batch_fn(step) -> (inputs, targets))")
    return BuiltModel(model=model, batch=batch)
