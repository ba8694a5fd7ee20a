"""A mixture-of-experts feed-forward: top-k router, capacity-based dispatch, SwiGLU experts.

Dispatch and combine use fixed-size buffers (experts x capacity x hidden), so
shapes never depend on the data: the layer traces into one static graph, and
the same layout is what an expert-parallel all-to-all exchanges. Tokens beyond
an expert's capacity are dropped (their expert output is zero), as in GShard.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE"]


class MoE(nn.Module):
    def __init__(
        self, hidden: int, ffn: int, *, experts: int = 8, top_k: int = 2, capacity_factor: float = 2.0
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..experts ({experts}), got {top_k}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.experts = experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        scale = 1.0 / math.sqrt(hidden)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) * scale)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, ffn) * scale)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) / math.sqrt(ffn))

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))

    def expert_costs(self, tokens: int) -> tuple[int, int, int]:
        """What expert parallelism splits and sends, for a micro-batch of ``tokens`` tokens (the profiler reads
        it): the number of experts, the bytes of expert weights, and the bytes of one forward's dispatch and
        combine all-to-alls on each rank (two ``[experts, capacity, hidden]`` buffers)."""
        weights = (self.w1, self.w2, self.w3)
        hidden = self.w2.shape[-1]
        buffer = self.experts * self.capacity(tokens) * hidden * self.w1.element_size()
        return self.experts, sum(w.numel() * w.element_size() for w in weights), 2 * buffer

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For flat tokens ``x`` [T, H]: each assignment's slot, gate weight and token index."""
        tokens = x.shape[0]
        capacity = self.capacity(tokens)
        probs = F.softmax(self.router(x), dim=-1)
        gate, expert = torch.topk(probs, self.top_k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        onehot = F.one_hot(flat_expert, self.experts)
        position = ((torch.cumsum(onehot, dim=0) - 1) * onehot).sum(dim=-1)
        keep = (position < capacity).to(x.dtype)
        slot = flat_expert * capacity + position.clamp(max=capacity - 1)
        token = torch.arange(tokens, device=x.device).repeat_interleave(self.top_k)
        return slot, gate.reshape(-1) * keep, token

    def dispatch(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Tokens into the [experts, capacity, H] buffer (dropped ones add zeros)."""
        capacity = self.capacity(x.shape[0])
        keep = (weight != 0).to(x.dtype).unsqueeze(-1)
        buffer = x.new_zeros(self.experts * capacity, x.shape[-1])
        buffer = buffer.index_add(0, slot, x[token] * keep)
        return buffer.view(self.experts, capacity, x.shape[-1])

    def expert_forward(self, buffer: torch.Tensor) -> torch.Tensor:
        """Every expert's SwiGLU on its slots: [E, C, H] -> [E, C, H]."""
        return torch.bmm(F.silu(torch.bmm(buffer, self.w1)) * torch.bmm(buffer, self.w3), self.w2)

    def combine(self, out: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
        """Gate-weighted sum of each token's expert outputs: [E, C, H] -> [T, H]."""
        rows = out.reshape(-1, out.shape[-1])[slot] * weight.unsqueeze(-1)
        return rows.view(tokens, self.top_k, -1).sum(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        slot, weight, token = self.route(flat)
        out = self.expert_forward(self.dispatch(flat, slot, weight, token))
        return self.combine(out, slot, weight, flat.shape[0]).view(shape)
