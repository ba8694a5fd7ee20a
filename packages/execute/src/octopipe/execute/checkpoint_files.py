"""Checkpoint folders of a run, without torch: where step ``n``'s checkpoint lives, the latest complete one,
and the commit that makes a written checkpoint visible.

The commit protocol (every save, synchronous or asynchronous; ``runtime.checkpoint`` writes the state):

1. Every rank of one launch writes into the same private folder ``step-<n>.partial-<token>``; the token is
   a short random hex that rank 0 draws once per launch and sends to the others, so ranks of an earlier
   attempt still writing (zombies) can never mix their files into this launch's folder.
2. torch.distributed.checkpoint writes ``.metadata`` last, on rank 0, after gathering every rank's write
   results: once it exists, every rank's data is in the folder.
3. Rank 0 then commits: it renames the folder to ``step-<n>`` (:func:`commit_checkpoint`). A complete
   ``step-<n>`` already there (a resumed run saving that step again) is first renamed aside to
   ``step-<n>.replaced-<hex>`` and deleted after the new one is in place, so a ``step-<n>`` folder never
   holds half a checkpoint (for a moment there may be none).

Folder ``step-<n>`` holds the state after ``n`` completed steps; a checkpoint is complete, and is the only
kind :func:`latest_checkpoint` returns and ``runtime.checkpoint.load_checkpoint`` reads, when a folder of
exactly that name holds ``.metadata``. Folders named ``step-<n>.partial-*`` (a save in flight, or one whose
writer died: never loaded, never deleted by a run, safe to delete by hand when no run writes) and
``step-<n>.replaced-*`` (a commit interrupted between its two renames: a complete older copy) and
``step-<n>.removing-*`` (a deletion in progress) are ignored. :func:`prune_checkpoints` keeps the newest K committed ones. The coordinator scans with
:func:`latest_checkpoint`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

__all__ = [
    "checkpoint_path",
    "commit_checkpoint",
    "committed_checkpoints",
    "latest_checkpoint",
    "partial_path",
    "prune_checkpoints",
]

_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_TOKEN = re.compile(r"^[0-9a-f]{1,32}$")


def checkpoint_path(folder: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` completed steps (complete once it holds ``.metadata``)."""
    return Path(folder) / f"step-{step}"


def partial_path(folder: str | Path, step: int, token: str) -> Path:
    """Where one launch (``token``) writes step ``step``'s checkpoint before it is committed."""
    if not _TOKEN.match(token):
        raise ValueError(f"a checkpoint token is 1-32 lowercase hex digits, got {token!r}")
    return Path(folder) / f"step-{step}.partial-{token}"


def committed_checkpoints(folder: str | Path) -> list[int]:
    """The steps with a complete, committed checkpoint under ``folder`` (``step-<n>`` with ``.metadata``), ascending."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _STEP_FOLDER.match(entry.name)) and (entry / ".metadata").is_file()
    )


def latest_checkpoint(folder: str | Path) -> int:
    """The highest step with a complete, committed checkpoint under ``folder``; 0 when there is none."""
    return max(committed_checkpoints(folder), default=0)


def _sync_folder(folder: Path) -> None:
    """Make renames inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: first out of the names readers look at (one rename), then its files."""
    doomed = path.with_name(f"{path.name}.removing-{secrets.token_hex(4)}")
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def commit_checkpoint(partial: str | Path, step: int) -> Path:
    """Rename the finished ``partial`` folder to ``step-<step>`` beside it (rank 0, after the save's ``.metadata``).

    A complete ``step-<step>`` already there is renamed aside, replaced, then deleted; an incomplete one (no
    ``.metadata``: written before this protocol existed) is deleted first. Returns the committed folder.
    """
    source = Path(partial)
    if not (source / ".metadata").is_file():
        raise FileNotFoundError(f"{source} has no .metadata: the save did not finish on every rank, nothing to commit")
    final = checkpoint_path(source.parent, step)
    aside: Path | None = None
    if final.exists():
        if (final / ".metadata").is_file():
            aside = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
            final.rename(aside)
        else:
            _remove(final)
    source.rename(final)
    _sync_folder(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def prune_checkpoints(folder: str | Path, keep: int, newest: int) -> list[int]:
    """Delete committed checkpoints older than the ``keep`` newest up to step ``newest`` (the one just committed).

    Committed checkpoints of later steps (left by an earlier attempt that got further) count as newer and
    are kept, as are partial and replaced folders. Returns the deleted steps. ``keep`` 0 deletes nothing.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (0: keep every checkpoint), got {keep}")
    if not keep:
        return []
    older = [step for step in committed_checkpoints(folder) if step <= newest]
    doomed = older[:-keep]
    for step in doomed:
        _remove(checkpoint_path(folder, step))
    return doomed
