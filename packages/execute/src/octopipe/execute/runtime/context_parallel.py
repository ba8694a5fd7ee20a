"""Context parallelism for the zoo's attention: every rank holds a slice of each sequence, attention sees it all.

The ``cp`` ranks of a context-parallel group hold consecutive, equal slices
of every sequence (rank c: tokens c*S/cp .. (c+1)*S/cp - 1). Every layer but
attention works token by token, so it runs on the slice as it is. Attention
(:class:`ContextParallelAttention`, Llama 3's all-gather form) rotates its
queries and keys by their true positions, all-gathers the keys and values of
the whole sequence over the group (``octopipe.transform.gather_sequence``:
its gradient is a reduce-scatter, so each rank gets back every rank's
gradient of its own keys and values) and attends its queries to all of them
under the causal mask of their true positions.

Each rank's loss is the mean over its slice; equal slices make the mean of
the ranks' losses the whole sequence's mean, so after the backward every
parameter's gradient is averaged over the group (``MeshRank``), as data
parallelism would. A Mamba scan needs the whole sequence in order: a model
with Mamba layers is refused.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from octopipe.examples.models import Attention, Mamba
from octopipe.transform.tensor_parallel import gather_sequence

__all__ = ["ContextParallelAttention", "context_parallel"]

M = TypeVar("M", bound=nn.Module)


class ContextParallelAttention(Attention):
    """``attention`` over a context-parallel group (see the module docstring); same parameters, same names."""

    def __init__(self, attention: Attention, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)  # not Attention.__init__: the weights are ``attention``'s, nothing is drawn
        self.heads, self.head_dim, self.dropout = attention.heads, attention.head_dim, attention.dropout
        self.wqkv, self.wo = attention.wqkv, attention.wo
        self.register_buffer("inv_freq", attention.inv_freq, persistent=False)
        self.group_name = str(group.group_name)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        offset = self.rank * seq
        qkv = self.wqkv(x).view(batch, seq, 3, self.heads, self.head_dim).transpose(1, 3)
        q, k, v = qkv.unbind(dim=2)
        q, k = self._rope(q, offset), self._rope(k, offset)
        k = gather_sequence(k, 2, self.group_name, self.world)  # [batch, heads, seq * cp, head_dim]
        v = gather_sequence(v, 2, self.group_name, self.world)
        queries = torch.arange(seq, device=x.device) + offset
        keys = torch.arange(seq * self.world, device=x.device)
        causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [seq, seq * cp]: a key at or before the query
        drop = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=drop)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def context_parallel(module: M, group: dist.ProcessGroup) -> M:
    """Replace every :class:`Attention` in ``module`` by its :class:`ContextParallelAttention` twin, in place.

    Raises ValueError for a module with Mamba layers (a scan cannot be split over the sequence)."""
    if dist.get_world_size(group) == 1:
        return module
    mamba = [name for name, sub in module.named_modules() if isinstance(sub, Mamba)]
    if mamba:
        raise ValueError(
            f"context parallelism splits the sequence, but {mamba[0]} is a Mamba layer whose scan needs the whole "
            "sequence in order: use cp=1 for this model"
        )
    dropout = [name for name, sub in module.named_modules() if getattr(sub, "dropout", 0.0)]
    if dropout:
        raise ValueError(
            f"context parallelism needs dropout 0, but {dropout[0]} has dropout (each rank would draw other random "
            "numbers than the whole sequence does): build the model without dropout"
        )
    targets = [(name, sub) for name, sub in module.named_modules() if type(sub) is Attention]
    for name, attention in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, ContextParallelAttention(attention, group))
    return module
