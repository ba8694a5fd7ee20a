"""A rank's checkpoint saver: synchronous, or asynchronous on one background thread, with the commit protocol.

One :class:`Checkpointer` per rank process (a collective to create: every rank,
in the same order as the other groups). It opens its own gloo process group, so
the saves' collectives never interleave with the pipeline's, and the launch's
token (``checkpoint.checkpoint_token``) that names its partial folders.

- **Synchronous** (``asynchronous=False``): :meth:`Checkpointer.save` writes
  ``step-<n>.partial-<token>`` and rank 0 commits it to ``step-<n>`` before it returns.
- **Asynchronous**: :meth:`Checkpointer.save` first waits for the previous save
  (at most ``timeout_s``; a failed one raises here), copies this rank's tensors
  (to the CPU: the next optimizer step updates them in place), hands the write
  and the commit to the one background thread and returns. The checkpoint is
  committed when every rank's write is done; a rank that dies before leaves only
  the partial folder, which is never loaded.

:meth:`Checkpointer.finish` waits for the save in flight and raises its error;
:meth:`Checkpointer.close` does that and stops the thread. A background error
is never dropped: it fails the next ``save``, ``finish`` or ``close``. With
``keep`` K > 0, rank 0 deletes committed checkpoints older than the newest K
after each commit (``checkpoint_files.prune_checkpoints``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from octopipe.execute.checkpoint_files import prune_checkpoints
from octopipe.execute.devices import CPU_BACKEND
from octopipe.execute.runtime.checkpoint import checkpoint_state, checkpoint_token, snapshot, write_checkpoint

__all__ = ["CheckpointError", "Checkpointer"]

#: how often a wait for the save in flight looks at the run's abort flag
_POLL_S = 0.1


class CheckpointError(RuntimeError):
    """A checkpoint save failed, or did not finish in time; the message names the step."""


class Checkpointer:
    """Saves and commits one rank's checkpoints under ``folder`` (see the module docstring).

    ``timeout_s`` bounds the gloo group's collectives and every wait for a save in flight; ``aborted``
    (the run's abort flag: a reason, or None) ends such a wait early. ``hold`` (fault tests): (step,
    seconds) this rank waits, after writing its data for that step, before reporting the write.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        asynchronous: bool,
        keep: int = 0,
        timeout_s: float,
        aborted: Callable[[], str | None] | None = None,
        hold: tuple[int, float] | None = None,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0: keep every checkpoint), got {keep}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.folder = Path(folder)
        self.asynchronous = asynchronous
        self.keep = keep
        self.timeout_s = timeout_s
        self._aborted = aborted
        self._hold = hold
        # collectives: every rank creates the group and learns the token, in this order
        # the snapshots are host tensors whatever the rank computes on: the host backend
        self.group = dist.new_group(backend=CPU_BACKEND, timeout=datetime.timedelta(seconds=timeout_s))
        self.token = checkpoint_token(self.group)
        self._thread = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="octopipe-checkpoint")
            if asynchronous
            else None
        )
        self._pending: tuple[int, concurrent.futures.Future[None]] | None = None
        self._copies: dict[str, torch.Tensor] | None = None  # the last snapshot, reused once its save is done

    def save(
        self, step: int, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, *, suffix: str = ""
    ) -> None:
        """Save the state after ``step`` completed steps: now, or started in the background (asynchronous)."""
        state = checkpoint_state(params, optimizer, suffix)
        if not self.asynchronous:
            self._write(state, step)
            return
        if self._thread is None:
            raise CheckpointError(f"the checkpoint of step {step} cannot start: this Checkpointer was closed")
        self.finish()  # one save in flight at a time; a failed one fails here
        # the previous save is written: its copies are free to take this one (memory allocated once)
        self._copies = snapshot(state, into=self._copies)
        self._pending = (step, self._thread.submit(self._write, self._copies, step))

    @property
    def in_flight(self) -> int | None:
        """The step whose asynchronous save has not been waited for yet (None: none)."""
        return None if self._pending is None else self._pending[0]

    def finish(self) -> None:
        """Wait for the save in flight (at most ``timeout_s``) and raise a CheckpointError if it failed."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                future.result(timeout=_POLL_S)
                return
            except concurrent.futures.TimeoutError:
                reason = self._aborted() if self._aborted is not None else None
                if reason:
                    self._copies = None  # the thread may still read them
                    raise CheckpointError(f"the checkpoint of step {step} was abandoned: {reason}") from None
                if time.monotonic() > deadline:
                    self._copies = None
                    raise CheckpointError(
                        f"the checkpoint of step {step} did not finish within {self.timeout_s:g} s (a rank stopped, "
                        "or the storage is too slow for the timeout: raise timeout_s)"
                    ) from None
            except Exception as exc:
                raise CheckpointError(f"the checkpoint of step {step} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for the last save (its error raised) and stop the background thread."""
        try:
            self.finish()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=False, cancel_futures=True)
                self._thread = None

    def _write(self, state: Mapping[str, torch.Tensor], step: int) -> None:
        hold_s = self._hold[1] if self._hold is not None and self._hold[0] == step else 0.0
        committed = write_checkpoint(state, self.folder, step, self.token, process_group=self.group, hold_s=hold_s)
        if committed is not None and self.keep:
            prune_checkpoints(self.folder, self.keep, newest=step)
