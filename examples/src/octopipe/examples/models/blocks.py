"""Building blocks of the zoo: RoPE attention, SwiGLU and squared-ReLU MLPs.

Plain torch, static shapes, no data-dependent control flow: every block traces
into one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "SquaredReluMLP", "SwiGLU"]


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings.

    The rotary frequencies are a (non-persistent) buffer, so capture must lift
    buffers as graph inputs as well as parameters.
    """

    inv_freq: torch.Tensor

    def __init__(self, hidden: int, heads: int, *, rope_base: float = 10000.0, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} must be divisible by the number of heads {heads}")
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        inv_freq = 1.0 / (rope_base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate ``x`` [..., seq, head_dim] by the positions offset .. offset + seq - 1."""
        seq = x.shape[-2]
        positions = torch.arange(seq, dtype=torch.float32, device=x.device)
        if offset:
            positions = positions + offset
        angles = torch.outer(positions, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # bf16 activations stay bf16
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.wqkv(x).view(batch, seq, 3, self.heads, self.head_dim).transpose(1, 3)
        q, k, v = qkv.unbind(dim=2)
        q, k = self._rope(q), self._rope(k)
        drop = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))  # -1: heads x head_dim (fewer under tp)


class SwiGLU(nn.Module):
    """The Llama feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SquaredReluMLP(nn.Module):
    """Nemotron-H's MLP: down(relu(up x)^2)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.square(F.relu(self.up(x))))
