"""The optimizer step as ``training.Optimization`` says, the same on every rank and in the eager reference.

:func:`make_optimizer` builds AdamW or SGD over the weights the optimizer steps (float32: the parameters;
bf16: the float32 masters), with a group without weight decay for 1-D parameters when asked;
:func:`set_learning_rate` sets the schedule's rate before each step.

:func:`clip_global_norm` is ``torch.nn.utils.clip_grad_norm_(..., foreach=False)`` over a model whose
gradients are spread over ranks. Each rank computes the 2-norm of every gradient it counts (a tied
parameter is counted by one holder; a data-parallel replica holds a shard of every parameter, so it
contributes the shard's squared norm), puts it at the parameter's place in the model's parameter order,
and one all-reduce (a sum over the world) assembles the whole vector on every rank: a whole tensor's norm
comes from exactly one rank (adding zeros is exact), a sharded one is the square root of its shards'
squares. The total is the 2-norm of that vector, over the parameters that have gradients, in the model's
order, so without data parallelism it is bitwise the single process's, and every gradient is multiplied
by the same clamped coefficient as there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from octopipe.execute.training import Optimization

__all__ = ["clip_global_norm", "make_optimizer", "set_learning_rate"]


def make_optimizer(
    params: Mapping[str, torch.nn.Parameter], ndims: Mapping[str, int], optimization: Optimization
) -> torch.optim.Optimizer:
    """The optimizer over ``params`` (by name); ``ndims``: each parameter's dimensions in the model (a
    shard is 1-D whatever it was: the groups follow the model's tensors)."""
    missing = sorted(set(params) - set(ndims))
    if missing:
        raise ValueError(f"parameters {missing[:3]} are not the model's: cannot tell their weight-decay group")
    decay = [p for n, p in params.items() if optimization.decays(ndims[n])]
    plain = [p for n, p in params.items() if not optimization.decays(ndims[n])]
    groups = [{"params": decay, "weight_decay": optimization.weight_decay}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    if optimization.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optimization.learning_rate, momentum=optimization.momentum, foreach=False)
    return torch.optim.AdamW(groups, lr=optimization.learning_rate, betas=optimization.betas, foreach=False)


def set_learning_rate(optimizer: torch.optim.Optimizer, optimization: Optimization, step: int) -> float:
    """Set every group's rate to the schedule's for ``step``; return it."""
    rate = optimization.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate


def clip_global_norm(
    grads: Mapping[str, torch.Tensor | None],
    order: Sequence[str],
    max_norm: float,
    *,
    counted: Collection[str] | None = None,
    sharded: bool = False,
    exchange: bool = True,
) -> float:
    """Clip ``grads`` (this rank's, by name, in place) to a global 2-norm of ``max_norm``; return the norm
    before clipping. ``order``: every parameter of the model, in its order; ``counted``: the names whose
    norm this rank contributes (default all it holds); ``sharded``: this rank's gradients are shards of
    data-parallel replicas. ``exchange=False``: a single process (the eager reference), nothing to add up."""
    index = {name: i for i, name in enumerate(order)}
    held = {name: g for name, g in grads.items() if g is not None}
    unknown = sorted(set(held) - set(index))
    if unknown:
        raise ValueError(f"gradients of {unknown[:3]} are not of the model's parameters: cannot place their norms")
    like = next(iter(held.values()), None)
    device = like.device if like is not None else torch.device("cpu")
    # [whole norms | squared shard norms | has a gradient], one entry per parameter of the model
    vector = torch.zeros(3 * len(order), dtype=torch.float32, device=device)
    for name, grad in held.items():
        if counted is not None and name not in counted:
            continue
        norm = torch.linalg.vector_norm(grad, 2.0)
        if sharded:
            vector[len(order) + index[name]] = norm * norm
        else:
            vector[index[name]] = norm
        vector[2 * len(order) + index[name]] = 1.0
    if exchange:
        dist.all_reduce(vector)  # every rank of the world: each holds its own parameters' norms
    whole, squares, present = vector.split(len(order))
    norms = torch.sqrt(squares) if sharded else whole
    total = torch.linalg.vector_norm(norms[present > 0], 2.0)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in held.values():
        grad.mul_(coefficient)
    return float(total)
