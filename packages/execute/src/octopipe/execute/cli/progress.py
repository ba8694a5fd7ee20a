"""Progress on stderr for CLI steps that take more than a second (nothing when output is JSON)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

__all__ = ["spinner"]


@contextmanager
def spinner(message: str, *, enabled: bool = True) -> Iterator[None]:
    """A spinner with ``message`` on stderr while the block runs; ``enabled=False`` (``--json``): nothing."""
    if not enabled:
        yield
        return
    with Console(stderr=True).status(message):
        yield
