"""Tensor-parallel parameters and the collectives that trace into a stage's graphs (Megatron-LM's f and g).

A tensor-parallel layer keeps only this rank's slice of each of its weights,
as a plain ``nn.Parameter`` under the parameter's own name, and calls one of
three differentiable functional collectives at its edges, so AOTAutograd
traces the all-reduces into the stage's forward and backward graphs:

- :func:`copy_to_tp` (Megatron's *f*): identity forward, all-reduce of the
  input gradient backward. In front of column-parallel weights, whose input
  gradient is a partial sum on every rank.
- :func:`reduce_from_tp` (Megatron's *g*): all-reduce forward, identity
  backward. After row-parallel weights, whose outputs are partial sums; the
  gradient arriving from the (replicated) rest of the model is the same on
  every rank.
- :func:`all_reduce_tp`: all-reduce both ways. For a partial sum whose result
  every rank then uses *differently* (only on its own channels), so each
  rank's gradient of it is again partial (Mamba's ``x_proj``).

How a parameter is sliced is a :class:`TPSpec`: along one dimension, in
``blocks`` equal blocks (a fused ``wqkv`` is 3 blocks, Mamba's ``in_proj`` 2),
each block cut into ``world`` equal chunks; rank ``r`` holds chunk ``r`` of
every block, concatenated. :func:`gather_tp` rebuilds the whole tensor (for
reports, checkpoints in the unsharded layout and comparisons with a
single-process reference).

The collectives are ``torch.distributed``'s functional ones
(``_c10d_functional.all_reduce`` then ``wait_tensor``): asynchronous, so a
graph pass may move the wait away from the issue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "TPSpec",
    "all_reduce_tp",
    "copy_to_tp",
    "gather_sequence",
    "gather_tp",
    "reduce_from_tp",
    "scatter_sequence",
    "shard_tp",
    "slice_parameter",
]

_functional = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = _functional.all_reduce(x.contiguous(), "sum", group_name)
    reduced: torch.Tensor = _functional.wait_tensor(out)
    return reduced


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group_name), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group_name), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
        ctx.dim, ctx.group_name, ctx.world = dim, group_name, world
        moved = x.movedim(dim, 0).contiguous()
        out = _functional.wait_tensor(_functional.all_gather_into_tensor(moved, world, group_name))
        gathered: torch.Tensor = out.movedim(0, dim)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = _functional.reduce_scatter_tensor(moved, "sum", ctx.world, ctx.group_name)
        scattered: torch.Tensor = _functional.wait_tensor(out).movedim(0, ctx.dim)
        return scattered, None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    """All-gather ``x``'s slices along ``dim`` over a group (rank order); the gradient is reduce-scattered
    (summed) back: each rank gets every rank's gradient of its own slice. Context parallelism's keys and
    values; sequence parallelism's entry into a tensor-parallel layer."""
    out: torch.Tensor = _GatherSequence.apply(x, dim, group_name, world)
    return out


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
        ctx.dim, ctx.group_name, ctx.world = dim, group_name, world
        moved = x.movedim(dim, 0).contiguous()
        out = _functional.wait_tensor(_functional.reduce_scatter_tensor(moved, "sum", world, group_name))
        scattered: torch.Tensor = out.movedim(0, dim)
        return scattered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = _functional.wait_tensor(_functional.all_gather_into_tensor(moved, ctx.world, ctx.group_name))
        gathered: torch.Tensor = out.movedim(0, ctx.dim)
        return gathered, None, None, None


def scatter_sequence(x: torch.Tensor, dim: int, group_name: str, world: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim`` (a reduce-scatter); the gradient is
    all-gathered. Sequence parallelism's exit from a tensor-parallel layer (Megatron's reduce-scatter)."""
    out: torch.Tensor = _ScatterSequence.apply(x, dim, group_name, world)
    return out


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity forward; the gradient is all-reduced over the tensor-parallel group (Megatron's f)."""
    out: torch.Tensor = _Copy.apply(x, group_name)
    return out


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-reduce (sum) forward; the gradient passes through unchanged (Megatron's g)."""
    out: torch.Tensor = _Reduce.apply(x, group_name)
    return out


def all_reduce_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-reduce (sum) forward and backward: a partial sum each rank then uses on its own channels only."""
    out: torch.Tensor = _ReduceBoth.apply(x, group_name)
    return out


@dataclass(kw_only=True, frozen=True)
class TPSpec:
    """How one parameter is sliced over a tensor-parallel group (see the module docstring)."""

    shape: tuple[int, ...]
    dim: int
    blocks: int
    world: int
    rank: int
    group_name: str

    def __post_init__(self) -> None:
        size = self.shape[self.dim]
        if size % (self.blocks * self.world):
            raise ValueError(
                f"a dimension of {size} cannot be cut into {self.blocks} block(s) x {self.world} tensor-parallel "
                f"ranks: choose a tp that divides {size // self.blocks}"
            )

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor ``full``."""
        chunks = [block.chunk(self.world, self.dim)[self.rank] for block in full.chunk(self.blocks, self.dim)]
        return torch.cat(chunks, self.dim).clone()


def slice_parameter(module: nn.Module, name: str, *, dim: int, blocks: int, group: dist.ProcessGroup) -> TPSpec:
    """Replace ``module.<name>`` by this rank's slice of it (a new ``nn.Parameter``) and return its spec."""
    param = getattr(module, name)
    spec = TPSpec(
        shape=tuple(param.shape),
        dim=dim % param.ndim,
        blocks=blocks,
        world=dist.get_world_size(group),
        rank=dist.get_rank(group),
        group_name=str(group.group_name),
    )
    with torch.no_grad():
        setattr(module, name, nn.Parameter(spec.local(param.detach()), requires_grad=param.requires_grad))
    return spec


def shard_tp(full: Mapping[str, torch.Tensor], specs: Mapping[str, TPSpec]) -> dict[str, torch.Tensor]:
    """This rank's slices of whole tensors (tensors without a spec are replicated: returned as they are)."""
    return {name: specs[name].local(t) if name in specs else t for name, t in full.items()}


def gather_tp(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The whole tensor from every rank's slice (a collective over the spec's group)."""
    with torch.no_grad():
        moved = local.detach().movedim(spec.dim, 0).contiguous()
        out = _functional.all_gather_into_tensor(moved, spec.world, spec.group_name)
        gathered: torch.Tensor = _functional.wait_tensor(out)  # [world * n, ...]: rank-major
        per_rank = gathered.chunk(spec.world, 0)
        blocks = [torch.cat([r.chunk(spec.blocks, 0)[b] for r in per_rank], 0) for b in range(spec.blocks)]
        return torch.cat(blocks, 0).movedim(0, spec.dim).contiguous()
