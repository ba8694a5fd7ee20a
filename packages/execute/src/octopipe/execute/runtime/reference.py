"""The single-process eager reference a pipelined run must reproduce.

Same model, same data, same micro-batches: each micro-batch's loss is scaled
by 1/m and back-propagated with eager autograd (gradients accumulate in
micro-batch order), then the optimizer steps as ``training.Optimization`` says (its groups, its
learning-rate schedule, and ``torch.nn.utils.clip_grad_norm_`` over the whole model when it clips) —
what every rank does for its stages.
On ``device`` (default the CPU): built from the seed on the CPU and moved, as
every rank's model is; the results come back as CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octopipe.execute.runtime.data import with_data
from octopipe.execute.runtime.models import build_model, on_device
from octopipe.execute.runtime.optim import make_optimizer, set_learning_rate
from octopipe.execute.runtime.precision import GRAD_DTYPE, Weights, in_precision
from octopipe.execute.runtime.pretrained import WeightSource, materialize, params_on_meta
from octopipe.execute.training import DataSpec, Optimization, WeightsSpec
from octopipe.plan.v1 import plan_pb2
from octopipe.transform.device import CPU, Device

__all__ = ["ReferenceResult", "reference_run"]


@dataclass
class ReferenceResult:
    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    #: each step's gradient norm before clipping (when it clips)
    grad_norms: list[float] = field(default_factory=list)


def reference_run(
    model_reference: plan_pb2.ModelReference,
    *,
    num_microbatches: int,
    steps: int = 1,
    seed: int = 0,
    optimization: Optimization | None = None,
    data: DataSpec | None = None,
    weights: WeightsSpec | None = None,
    device: Device = CPU,
    dtype: torch.dtype = torch.float32,
) -> ReferenceResult:
    """``weights.load``: the initial weights are read from that folder (every parameter, in this process).
    ``dtype``: the plan's compute dtype (``precision.plan_dtype``); bf16 runs the mixed-precision policy of
    ``runtime.precision`` and returns the float32 masters as ``params``; ``grads`` are the first step's
    gradients, summed over micro-batches in float32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on every rank: reductions split over threads can round differently
    try:
        with device.current():
            chosen = optimization if optimization is not None else Optimization()
            load = weights.load if weights is not None else ""
            return _reference(model_reference, num_microbatches, steps, seed, chosen, data, load, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _reference(
    model_reference: plan_pb2.ModelReference,
    num_microbatches: int,
    steps: int,
    seed: int,
    optimization: Optimization,
    data: DataSpec | None,
    load: str,
    device: Device,
    dtype: torch.dtype,
) -> ReferenceResult:
    """Per micro-batch gradients (eager autograd, in the compute dtype), summed in float32 in micro-batch
    order as every rank sums them; AdamW on the weights (float32: the parameters; bf16: float32 masters,
    rounded back after each step)."""
    if load:  # parameters on the meta device, then every one read from the folder
        with params_on_meta():
            built = build_model(model_reference, seed=seed)
        materialize(built.model, [], [n for n, _ in built.model.named_parameters()], WeightSource(load), CPU)
    else:
        built = build_model(model_reference, seed=seed)
    built = on_device(in_precision(with_data(built, data) if data is not None else built, dtype), device)
    params = dict(built.model.named_parameters())
    weights = Weights(params)
    optimizer = make_optimizer(weights.optimized, {n: p.ndim for n, p in params.items()}, optimization)
    norms: list[float] = []
    scale = torch.ones(()) / num_microbatches
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for step in range(steps):
        tokens, targets = built.batch(step)
        step_losses = []
        summed: dict[str, torch.Tensor] = {}
        for x, y in zip(tokens.chunk(num_microbatches), targets.chunk(num_microbatches), strict=True):
            loss = built.loss(x, y)  # the model's own call (by argument names for a whole-model capture)
            step_losses.append(loss.detach())
            grads = torch.autograd.grad(loss * scale, list(params.values()), allow_unused=True)
            for name, grad in zip(params, grads, strict=True):
                if grad is not None:
                    grad = grad.to(GRAD_DTYPE)
                    summed[name] = grad if name not in summed else summed[name] + grad
        losses.append(float(torch.stack(step_losses).sum() * scale))
        for name in params:
            weights.set_grad(name, summed.get(name))
        if step == 0:
            first = {n: CPU.put(g).clone() for n, g in summed.items()}
        if optimization.clip_grad_norm:
            masters = list(weights.optimized.values())
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, optimization.clip_grad_norm, foreach=False)))
        set_learning_rate(optimizer, optimization, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.publish()
    return ReferenceResult(
        losses=losses,
        grads=first,
        params={n: CPU.put(p.detach()).clone() for n, p in weights.optimized.items()},
        grad_norms=norms,
    )
