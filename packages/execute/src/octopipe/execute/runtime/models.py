"""Building the model a Plan names, the same way on every rank.

A ``ModelReference`` with ``source = "octopipe.examples:workload"`` names one of
shared/benchmarks.md's workloads (``name``); its ``config`` may override the
workload's sizes (``tiny``, ``sequence``, ``global_batch``, and any
``ModelConfig`` field such as ``hidden`` or ``dropout``). Any other source is
``package.module:function``: the function is called with the config as keyword
arguments (strings) and must return ``(model, batch_fn)``, where
``batch_fn(step) -> (inputs, targets)`` gives the global batch of a step.

How the stages are made: the config key ``capture`` (taken out before the
call) is ``whole`` -- the model's own training forward is captured as one graph
and split at layer boundaries (``octopipe.capture.trace_model`` and
``split_graph``), so everything its ``forward`` computes runs -- or ``stages``
-- the layer list (``pipeline_layers()``/``split_model``). The default is
``whole`` for transformers models and ``stages`` otherwise. A whole-model
source is called as ``model(<first>=inputs, labels=targets)`` when its
``forward`` takes ``labels`` (HuggingFace), else ``model(<first>=inputs,
<second>=targets)``, with its first two parameter names.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.execute.runs import WORKLOAD_SOURCE
from octopipe.plan.v1 import plan_pb2
from octopipe.transform.device import Device

__all__ = ["BuiltModel", "build_model", "model_inputs", "on_device", "workload_reference"]


@dataclass(frozen=True, eq=False)
class BuiltModel:
    model: nn.Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    #: whole-model capture: the names the model is called with, ``(inputs name, targets name)``;
    #: None: the layer-list route, the model called as ``model(inputs, targets)``
    input_names: tuple[str, str] | None = None

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's own eager loss for one micro-batch, called as the user calls it."""
        if self.input_names is None:
            return self.model(inputs, targets)
        out = self.model(**model_inputs(self.input_names, inputs, targets))
        return out if isinstance(out, torch.Tensor) else out.loss


def on_device(built: BuiltModel, device: Device) -> BuiltModel:
    """``built`` with its model moved to ``device`` (in place: built from the seed on the CPU first, so every
    device starts from the same weights) and its batches made there (on the CPU: the same tensors). Meta
    parameters (a model loaded stage by stage) stay meta: ``runtime.pretrained.materialize`` places them."""
    if any(p.is_meta for p in built.model.parameters()):  # loaded stage by stage later: the buffers move now
        for module in built.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = device.put(buffer)
    else:
        device.put(built.model)
    full = built.batch

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = full(step)
        return device.put(inputs), device.put(targets)

    return dataclasses.replace(built, batch=batch)


def model_inputs(names: tuple[str, str], inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """One micro-batch by the model's argument names."""
    return {names[0]: inputs, names[1]: targets}


def _call_names(model: nn.Module) -> tuple[str, str]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if "labels" in params and params[0] != "labels":
        return params[0], "labels"
    if len(params) < 2:
        raise TypeError(
            f"{type(model).__name__}.forward takes {params}: a whole-model capture needs (inputs, targets) or labels="
        )
    return params[0], params[1]


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
    config = dict(reference.config)
    capture = config.pop("capture", "")
    if capture not in ("", "whole", "stages"):
        raise ValueError(f"model config capture={capture!r}: use 'whole' (the model's forward as written) or 'stages'")
    torch.manual_seed(seed)
    model, batch = function(**config)
    if not isinstance(model, nn.Module) or not callable(batch):
        raise TypeError(f"{reference.source} must return (nn.Module, batch_fn(step) -> (inputs, targets))")
    if not capture:
        capture = "whole" if type(model).__module__.startswith("transformers.") else "stages"
    names = _call_names(model) if capture == "whole" else None
    return BuiltModel(model=model, batch=batch, input_names=names)
