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
from octopipe.node.v1 import node_pb2

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


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    return None, at


def _write_atomic(path: Path, data: bytes) -> None:
    scratch = path.with_suffix(path.suffix + ".tmp")
    with open(scratch, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)


class StateStore:
    """``<state_dir>/runs/<run_id>/{submit,run}.binpb`` and ``metrics.binpb`` (the run's StepMetrics, each a
    varint length and the message, appended as they arrive)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder / "runs"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._log = structlog.get_logger("octopipe.coordinator.state")

    def save(self, submit: coordinator_pb2.SubmitPlanRequest, run: coordinator_pb2.Run) -> None:
        folder = self.folder / run.run_id
        folder.mkdir(exist_ok=True)
        _write_atomic(folder / "submit.binpb", submit.SerializeToString(deterministic=True))
        _write_atomic(folder / "run.binpb", run.SerializeToString(deterministic=True))

    def append_metrics(self, run_id: str, metrics: node_pb2.StepMetrics) -> None:
        data = metrics.SerializeToString(deterministic=True)
        folder = self.folder / run_id
        folder.mkdir(exist_ok=True)
        with open(folder / "metrics.binpb", "ab") as handle:
            handle.write(_varint(len(data)) + data)

    def load_metrics(self, run_id: str) -> list[node_pb2.StepMetrics]:
        """The run's stored metrics in arrival order (a torn last record, from a crash, is left out)."""
        path = self.folder / run_id / "metrics.binpb"
        if not path.is_file():
            return []
        data, found, at = path.read_bytes(), [], 0
        while at < len(data):
            size, at = _read_varint(data, at)
            if size is None or at + size > len(data):
                self._log.warning("metrics_record_torn", run=run_id, offset=at)
                break
            found.append(node_pb2.StepMetrics.FromString(data[at : at + size]))
            at += size
        return found

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
