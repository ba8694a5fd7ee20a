"""A plan's mixed-precision policy on a rank: the weights the model computes with and the weights the
optimizer steps.

``float32`` (a plan without ``precision``): one set of weights, the parameters themselves. ``bfloat16``:
the model is cast to bf16 (parameters, floating buffers, so its activations) before it is captured; the
optimizer steps float32 master copies made from those bf16 parameters (as Megatron-LM does), its AdamW
state is float32, the interpreter accumulates each weight gradient over micro-batches in float32
(``RankRuntime.grad_dtype``), and after every step the masters are rounded back into the bf16
parameters. Checkpoints hold the masters. The eager reference (``runtime.reference``) runs the same
policy, op for op, so a bf16 pipeline equals it bitwise, as a float32 one does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from octopipe.execute.runtime.models import BuiltModel
from octopipe.ir import compute_dtype
from octopipe.plan.v1 import plan_pb2

__all__ = ["GRAD_DTYPE", "Weights", "dtype_named", "in_precision", "plan_dtype"]

#: what weight gradients accumulate in and what the optimizer steps, whatever the compute dtype
GRAD_DTYPE = torch.float32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def plan_dtype(plan: plan_pb2.Plan) -> torch.dtype:
    """The torch dtype the plan's parameters and activations are held in (``ir.compute_dtype``)."""
    return _DTYPES[compute_dtype(plan)]


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a ``precision.compute_dtype`` name (``float32`` or ``bfloat16``; '' is float32)."""
    policy = plan_pb2.Plan()
    policy.precision.compute_dtype = name
    return plan_dtype(policy)


def in_precision(built: BuiltModel, dtype: torch.dtype) -> BuiltModel:
    """``built`` with its model's floating parameters and buffers cast to ``dtype`` (in place; integer buffers
    and the batches, token ids, are left as they are). A model captured as written (``input_names``) runs only
    in float32 for now: its bf16 numerics (tied weights summed across stages, the launch guard) are untested,
    so it is refused rather than run differently from its own training."""
    if dtype != GRAD_DTYPE and built.input_names is not None:
        raise ValueError(
            f"precision {str(dtype).removeprefix('torch.')} is not supported yet for a model captured as written "
            "(a transformers model or capture=whole): run it in float32"
        )
    built.model.to(dtype)
    return built


class Weights:
    """The parameters a rank computes with, and the ones its optimizer steps (the same, or float32 masters)."""

    def __init__(self, params: Mapping[str, nn.Parameter]) -> None:
        self.model = dict(params)
        #: True when the model computes in a lower precision than the optimizer steps
        self.mixed = any(p.dtype != GRAD_DTYPE for p in self.model.values())
        self.optimized: dict[str, nn.Parameter] = (
            {name: nn.Parameter(p.detach().to(GRAD_DTYPE).clone()) for name, p in self.model.items()}
            if self.mixed
            else self.model
        )

    def set_grad(self, name: str, grad: torch.Tensor | None) -> None:
        """The step's accumulated gradient (float32) of parameter ``name``, for the optimizer."""
        target = self.optimized[name]
        target.grad = None if grad is None else grad.to(target.dtype)

    def grad(self, name: str) -> torch.Tensor | None:
        return self.optimized[name].grad

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer stepped the masters: round them into the parameters the model computes with."""
        if self.mixed:
            for name, param in self.model.items():
                param.copy_(self.optimized[name])
