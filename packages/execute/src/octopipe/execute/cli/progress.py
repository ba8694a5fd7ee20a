"""Progress on stderr for CLI steps that take more than a second (nothing when output is JSON)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["spinner", "step_bar"]


@contextmanager
def spinner(message: str, *, enabled: bool = True) -> Iterator[None]:
    """A spinner with ``message`` on stderr while the block runs; ``enabled=False`` (``--json``): nothing."""
    if not enabled:
        yield
        return
    with Console(stderr=True).status(message):
        yield


@contextmanager
def step_bar(message: str, total: int, *, enabled: bool = True) -> Iterator[Callable[[int, float | None], None]]:
    """A progress bar of ``total`` steps on stderr; yields ``advance(step, loss)`` to call as each step ends
    (the loss shown when given). ``enabled=False`` (``--json``): nothing, and advance does nothing."""
    if not enabled:
        yield lambda step, loss: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(message, total=total, loss="-")

        def advance(step: int, loss: float | None) -> None:
            shown = f"{loss:.4f}" if loss is not None else progress.tasks[0].fields["loss"]
            progress.update(task, completed=step + 1, loss=shown)

        yield advance
