"""The coordinator's durable records: one folder per run with its submission and its latest record.

Files are written to a temporary name and renamed, so a crash leaves either
the old or the new record, never half of one. Records are protobuf, never
pickles.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

import structlog

from octopipe.coordinator.v1 import coordinator_pb2

__all__ = ["StateLock", "StateStore"]


class StateLock:
    """An exclusive lock on a coordinator's state folder (``<folder>/coordinator.lock``, holding the owner's pid),
    so two live coordinators never share one; the kernel drops it when its process ends."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "coordinator.lock"
        handle = open(self.path, "a+")  # noqa: SIM115 (held open for the coordinator's life)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise OSError(
                f"state folder {folder} is held by another live coordinator (pid {owner}): stop it, or give this "
                "one another --state-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


def _write_atomic(path: Path, data: bytes) -> None:
    scratch = path.with_suffix(path.suffix + ".tmp")
    with open(scratch, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)


class StateStore:
    """``<state_dir>/runs/<run_id>/{submit,run}.binpb``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "runs"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log = structlog.get_logger("octopipe.coordinator.state")

    def save(self, submit: coordinator_pb2.SubmitPlanRequest, run: coordinator_pb2.Run) -> None:
        folder = self.folder / run.run_id
        folder.mkdir(exist_ok=True)
        _write_atomic(folder / "submit.binpb", submit.SerializeToString(deterministic=True))
        _write_atomic(folder / "run.binpb", run.SerializeToString(deterministic=True))

    def load(self) -> list[tuple[coordinator_pb2.SubmitPlanRequest, coordinator_pb2.Run]]:
        """Every readable record; an unreadable one is logged and skipped, not fatal."""
        records = []
        for folder in sorted(self.folder.iterdir()):
            try:
                submit = coordinator_pb2.SubmitPlanRequest.FromString((folder / "submit.binpb").read_bytes())
                run = coordinator_pb2.Run.FromString((folder / "run.binpb").read_bytes())
            except (OSError, ValueError) as exc:
                self._log.warning("run_record_unreadable", folder=str(folder), error=str(exc))
                continue
            records.append((submit, run))
        return records
