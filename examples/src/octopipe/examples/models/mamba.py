"""A Mamba-style selective state-space mixer in plain torch (a sequential scan).

``heads=None`` gives Mamba-1's per-channel state matrix A [D, N]; an integer
gives a Mamba-2-style scalar decay per head (A [heads]) shared by the head's
channels, as in Nemotron-H. The scan is a loop over the sequence: slow but
plain, every step an ordinary ATen op, so it traces and differentiates like any
other layer. Keep sequences short in tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Mamba"]


class Mamba(nn.Module):
    def __init__(
        self, hidden: int, *, d_state: int = 16, d_conv: int = 4, expand: int = 2, heads: int | None = None
    ) -> None:
        super().__init__()
        inner = expand * hidden
        if heads is not None and inner % heads:
            raise ValueError(f"inner size {inner} (expand x hidden) must be divisible by heads {heads}")
        self.inner, self.d_state, self.heads = inner, d_state, heads
        self.dt_rank = max(1, math.ceil(hidden / 16))
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, d_conv, groups=inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner if heads is None else heads)
        if heads is None:
            a = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(inner, 1)
        else:
            a = torch.arange(1, heads + 1, dtype=torch.float32)
        self.a_log = nn.Parameter(torch.log(a))
        self.d = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        xz = self.in_proj(x)
        u, z = xz.chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :seq].transpose(1, 2))
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # [B, S, inner] or [B, S, heads]
        a = -torch.exp(self.a_log)
        if self.heads is None:
            decay = torch.exp(dt.unsqueeze(-1) * a)  # [B, S, inner, N]
        else:
            per_channel = (dt * a).repeat_interleave(self.inner // self.heads, dim=-1)  # [B, S, inner]
            decay = torch.exp(per_channel).unsqueeze(-1)  # [B, S, inner, 1]
            dt = dt.repeat_interleave(self.inner // self.heads, dim=-1)
        drive = (dt * u).unsqueeze(-1) * b.unsqueeze(-2)  # [B, S, inner, N]
        state = x.new_zeros(batch, self.inner, self.d_state)
        outputs = []
        # unbind once: its backward is one stack, where indexing [:, t] per step would
        # materialise a full-size gradient per step (quadratic memory traffic)
        readout = c.unsqueeze(-2).unbind(1)
        for decay_t, drive_t, readout_t in zip(decay.unbind(1), drive.unbind(1), readout, strict=True):
            state = decay_t * state + drive_t
            outputs.append((state * readout_t).sum(dim=-1))
        y = torch.stack(outputs, dim=1) + u * self.d
        return self.out_proj(y * F.silu(z))
