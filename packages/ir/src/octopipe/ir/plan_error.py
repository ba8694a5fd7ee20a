"""The error every malformed plan raises (its own module, so that plan and mesh both import it)."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan that is malformed; the message says where and what to change."""
