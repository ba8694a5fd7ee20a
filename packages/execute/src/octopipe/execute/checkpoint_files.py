"""Checkpoint folders of a run, without torch: where step ``n``'s checkpoint lives, and the latest complete one.

Folder ``step-<n>`` holds the state after ``n`` completed steps; it is
complete once its ``.metadata`` file exists (torch.distributed.checkpoint
writes it last). The coordinator scans for it; ``runtime.checkpoint`` writes
and reads the state.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["checkpoint_path", "latest_checkpoint"]

_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def checkpoint_path(folder: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` completed steps."""
    return Path(folder) / f"step-{step}"


def latest_checkpoint(folder: str | Path) -> int:
    """The highest step with a complete checkpoint under ``folder``; 0 when there is none."""
    root = Path(folder)
    if not root.is_dir():
        return 0
    steps = [
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _STEP_FOLDER.match(entry.name)) and (entry / ".metadata").is_file()
    ]
    return max(steps, default=0)
