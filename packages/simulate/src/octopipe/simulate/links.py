"""A point-to-point link's cost: latency plus bytes over bandwidth."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Link"]


class _Measured(Protocol):
    """A measured link or collective cost message."""

    @property
    def latency_us(self) -> float: ...

    @property
    def bandwidth_bytes_per_second(self) -> float: ...


@dataclass(kw_only=True, frozen=True, slots=True)
class Link:
    """A one-way link: a transfer of n bytes takes latency + n / bandwidth."""

    latency_us: float = 0.0
    bandwidth_bytes_per_second: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.latency_us < math.inf:
            raise ValueError(f"Link.latency_us must be a finite time >= 0, got {self.latency_us}")
        if not self.bandwidth_bytes_per_second > 0:
            raise ValueError(
                f"Link.bandwidth_bytes_per_second must be > 0 (math.inf for free transfers), "
                f"got {self.bandwidth_bytes_per_second}"
            )

    @classmethod
    def from_proto(cls, cost: _Measured) -> Link:
        """From a measured cost message (``profile.v1.LinkCost`` or ``CollectiveCost``): latency and bandwidth."""
        return cls(latency_us=cost.latency_us, bandwidth_bytes_per_second=cost.bandwidth_bytes_per_second)

    def transfer_us(self, num_bytes: int) -> float:
        """Microseconds to move ``num_bytes`` over this link."""
        if num_bytes == 0:
            return self.latency_us
        return self.latency_us + num_bytes / self.bandwidth_bytes_per_second * 1e6
