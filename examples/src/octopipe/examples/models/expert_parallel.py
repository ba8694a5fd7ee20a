"""Expert parallelism for the zoo's MoE: experts sharded over a process group, tokens exchanged by all-to-all.

Every rank routes its own tokens (its own micro-batch) with a replicated
router and fills the same fixed ``[experts, capacity, hidden]`` dispatch buffer
as the unsharded :class:`~octopipe.examples.models.moe.MoE`. With ``W`` ranks
and ``E`` experts, rank ``r`` holds experts ``r*E/W .. (r+1)*E/W - 1``:

1. *dispatch* all-to-all: the buffer's dim 0 splits into ``W`` equal chunks
   of ``E/W`` experts; chunk ``d`` goes to rank ``d``. Rank ``r`` receives
   ``[W, E/W, capacity, hidden]``: every source's tokens for its experts.
2. the local experts run on ``[E/W, W*capacity, hidden]``;
3. *combine* all-to-all: the reverse exchange returns each source's outputs
   as ``[E, capacity, hidden]``, and the gate-weighted combine runs locally.

The layout is static (every rank must route the same number of tokens, so
capacities agree), which makes the all-to-all splits static too. The
exchanges use torch.distributed's *functional* collectives
(``_c10d_functional.all_to_all_single`` then ``wait_tensor``), so
AOTAutograd traces them into a stage's forward and backward graphs, where a
graph pass can move the wait away from the issue to overlap other compute.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from octopipe.examples.models.moe import MoE

__all__ = ["ExpertParallelMoE", "all_to_all", "expert_parallel"]

M = TypeVar("M", bound=nn.Module)


def _exchange(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    splits = [x.shape[0] // world] * world
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """An all-to-all in equal dim-0 chunks; its gradient is the same exchange of the output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
        ctx.group_name = group_name
        ctx.world = world
        return _exchange(x, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad, ctx.group_name, ctx.world), None, None


def all_to_all(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Differentiable all-to-all of ``x`` split into ``world`` equal chunks along dim 0 (functional collectives)."""
    if x.shape[0] % world:
        raise ValueError(f"dim 0 of the all-to-all input ({x.shape[0]}) must be divisible by the group size {world}")
    out: torch.Tensor = _AllToAll.apply(x, group_name, world)
    return out


class ExpertParallelMoE(MoE):
    """The twin of ``moe`` with its experts sharded over ``group`` (see the module docstring).

    ``w1``, ``w3`` and ``w2`` hold only this rank's ``experts // world``
    experts (copied from ``moe``); the router is a copy of ``moe``'s.
    Parameter names are the MoE's.
    """

    def __init__(self, moe: MoE, group: dist.ProcessGroup) -> None:
        world = dist.get_world_size(group)
        if moe.experts % world:
            raise ValueError(
                f"{moe.experts} experts cannot be sharded over {world} ranks: make experts a multiple of the group size"
            )
        nn.Module.__init__(self)  # not MoE.__init__: the weights come from ``moe``, nothing is drawn at random
        self.experts = moe.experts
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.group_name = str(group.group_name)
        self.world = world
        self.rank = dist.get_rank(group)
        self.local_experts = moe.experts // world
        local = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        self.router = copy.deepcopy(moe.router)
        with torch.no_grad():
            self.w1 = nn.Parameter(moe.w1[local].clone())
            self.w3 = nn.Parameter(moe.w3[local].clone())
            self.w2 = nn.Parameter(moe.w2[local].clone())

    def expert_forward(self, buffer: torch.Tensor) -> torch.Tensor:
        """[E, C, H] of this rank's tokens -> [E, C, H] of their expert outputs, via two all-to-alls."""
        experts, capacity, hidden = buffer.shape
        local, world = self.local_experts, self.world
        received = all_to_all(buffer, self.group_name, world)  # [W * L, C, H]: source-major
        tokens = received.view(world, local, capacity, hidden).transpose(0, 1).reshape(local, world * capacity, hidden)
        out = torch.bmm(F.silu(torch.bmm(tokens, self.w1)) * torch.bmm(tokens, self.w3), self.w2)
        back = out.view(local, world, capacity, hidden).transpose(0, 1).reshape(experts, capacity, hidden)
        return all_to_all(back, self.group_name, world)  # [E, C, H]: expert-major again


def expert_parallel(model: M, group: dist.ProcessGroup) -> M:
    """Replace every :class:`MoE` in ``model`` by its :class:`ExpertParallelMoE` twin over ``group``, in place.

    Every rank must build ``model`` identically (same seed) first; afterwards
    rank ``r`` keeps only its slice of each MoE's experts. Returns ``model``.
    """
    targets = [(name, m) for name, m in model.named_modules() if type(m) is MoE]
    if not targets:
        raise ValueError("the model has no MoE layer to shard: build it with MoE feed-forwards (e.g. moe_decoder)")
    for name, moe in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallelMoE(moe, group))
    return model
