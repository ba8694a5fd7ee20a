"""Verification errors: each names the rank, step and action, and carries a grid around it."""

from __future__ import annotations

from octopipe.ir.grid import format_grid
from octopipe.ir.plan_error import PlanError
from octopipe.plan.v1 import plan_pb2

__all__ = [
    "ActionCountError",
    "DeadlockError",
    "MemoryCapError",
    "MissingInputError",
    "VerificationError",
]


class VerificationError(PlanError):
    """A plan the static verifier rejects.

    ``rank``, ``step`` (the index in the rank's program) and ``action`` (its
    text) say where; the message says what to change and ends with a rank x
    step grid around that cell (``grid``).
    """

    def __init__(self, plan: plan_pb2.Plan, rank: int, step: int, action: str, problem: str) -> None:
        self.rank = rank
        self.step = step
        self.action = action
        self.grid = format_grid(plan, focus=(rank, step))
        where = f"rank {rank}, step {step} ({action})" if action else f"rank {rank}, step {step}"
        super().__init__(f"{where}: {problem}\n{self.grid}")


class DeadlockError(VerificationError):
    """The plan cannot finish: a circular wait, an unmatched send or receive, or pairs matched out of order."""


class MissingInputError(VerificationError):
    """An action needs something that is never produced before it (its input, its forward, its parameters)."""


class ActionCountError(VerificationError):
    """A micro-batch lacks its F or its B (or I and W) on some stage, or an action appears twice."""


class MemoryCapError(VerificationError):
    """A rank holds more bytes than its cap; ``time_us`` is when it first goes over, ``excess_bytes`` by how much at peak."""

    def __init__(
        self,
        plan: plan_pb2.Plan,
        rank: int,
        step: int,
        action: str,
        problem: str,
        *,
        cap_bytes: int,
        peak_bytes: int,
        time_us: float,
    ) -> None:
        self.cap_bytes = cap_bytes
        self.peak_bytes = peak_bytes
        self.excess_bytes = peak_bytes - cap_bytes
        self.time_us = time_us
        super().__init__(plan, rank, step, action, problem)
