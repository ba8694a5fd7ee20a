"""The single-process eager reference a pipelined run must reproduce.

Same model, same data, same micro-batches: each micro-batch's loss is scaled
by 1/m and back-propagated with eager autograd (gradients accumulate in
micro-batch order), then AdamW steps — what every rank does for its stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octopipe.execute.runtime.models import build_model
from octopipe.plan.v1 import plan_pb2

__all__ = ["ReferenceResult", "reference_run"]


@dataclass
class ReferenceResult:
    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def reference_run(
    model_reference: plan_pb2.ModelReference,
    *,
    num_microbatches: int,
    steps: int = 1,
    seed: int = 0,
    learning_rate: float = 1e-3,
) -> ReferenceResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on every rank: reductions split over threads can round differently
    try:
        return _reference(model_reference, num_microbatches, steps, seed, learning_rate)
    finally:
        torch.set_num_threads(threads)


def _reference(
    model_reference: plan_pb2.ModelReference, num_microbatches: int, steps: int, seed: int, learning_rate: float
) -> ReferenceResult:
    built = build_model(model_reference, seed=seed)
    model = built.model
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=learning_rate, foreach=False)
    scale = torch.ones(()) / num_microbatches
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for step in range(steps):
        tokens, targets = built.batch(step)
        step_losses = []
        for x, y in zip(tokens.chunk(num_microbatches), targets.chunk(num_microbatches), strict=True):
            loss = built.loss(x, y)  # the model's own call (by argument names for a whole-model capture)
            step_losses.append(loss.detach())
            (loss * scale).backward()
        losses.append(float(torch.stack(step_losses).sum() * scale))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return ReferenceResult(
        losses=losses, grads=first, params={n: p.detach().clone() for n, p in model.named_parameters()}
    )
