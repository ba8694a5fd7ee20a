"""A rank's collective stream: UNSHARD and REDUCE_GRAD run in program order beside the compute, as simulated.

The program (:mod:`octopipe.ir.program`) puts UNSHARD, RESHARD and
REDUCE_GRAD on the rank's collective stream: posted at their place in the
program, run one after the other in that order, never blocking the program;
a computation waits only for the UNSHARDs of its own stages, and the step
ends when the stream has drained. This class is that stream on a host thread
(on gloo a collective blocks the thread that waits for it; on CUDA the same
thread queues NCCL work on the process group's own stream): ``submit`` posts
an operation and returns at once, :meth:`Pending.wait` blocks the program
only where the program says it must. Every member of a data-parallel group
runs the same program, so they post the same collectives in the same order.

Each operation records when it was posted, started and ended (host clock,
``time.perf_counter_ns``, comparable with the runtime's action records), so
the timeline shows what overlapped what.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from octopipe.execute.runs import ActionRecord
from octopipe.execute.runtime.comm import Aborted, CommTimeout
from octopipe.transform.device import CPU, Device

__all__ = ["CollectiveStream", "CollectiveTimes", "Pending", "collective_records"]

T = TypeVar("T")

#: how often a waiting program looks at the run's abort flag
_POLL_S = 0.2


@dataclass(frozen=True)
class CollectiveTimes:
    """When one collective was posted by the program, and started and ended on the stream (host ns)."""

    label: str
    posted_ns: int
    start_ns: int
    end_ns: int


@dataclass(eq=False)
class Pending(Generic[T]):
    """A posted collective; ``wait`` returns its result."""

    label: str
    run: Callable[[], T]
    timeout_s: float
    aborted: Callable[[], str | None]
    posted_ns: int = field(default_factory=time.perf_counter_ns)
    start_ns: int = 0
    end_ns: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None

    def wait(self, what: str) -> T:
        """Block until the collective has ended (every wait has a deadline); raise what it raised."""
        deadline = time.monotonic() + self.timeout_s
        while not self.done.wait(_POLL_S):
            message = self.aborted()
            if message is not None:
                raise Aborted(f"{what}: stopped because {message}")
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: {self.label} did not complete within {self.timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"{what}: {self.label} failed: {self.error}") from self.error
        return self.result  # type: ignore[return-value]

    @property
    def times(self) -> CollectiveTimes:
        return CollectiveTimes(self.label, self.posted_ns, self.start_ns, self.end_ns)


class CollectiveStream:
    """One thread that runs posted collectives in order (see the module docstring)."""

    def __init__(self, *, timeout_s: float, aborted: Callable[[], str | None], device: Device = CPU) -> None:
        self.timeout_s, self.aborted, self.device = timeout_s, aborted, device
        self._ops: queue.SimpleQueue[Pending[object] | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="octopipe-collectives", daemon=True)
        self._thread.start()

    def submit(self, label: str, run: Callable[[], T]) -> Pending[T]:
        """Post ``run`` (a collective and the copies around it); it starts when the ones before it have ended."""
        pending: Pending[T] = Pending(label, run, self.timeout_s, self.aborted)
        self._ops.put(pending)  # type: ignore[arg-type]
        return pending

    def _loop(self) -> None:
        with self.device.current():  # the rank's GPU, as on the program's thread
            while (op := self._ops.get()) is not None:
                op.start_ns = time.perf_counter_ns()
                if self._broken is not None:  # a failed collective leaves the group unusable: fail the rest
                    op.error = self._broken
                else:
                    try:
                        op.result = op.run()
                    except Exception as exc:  # handed to the program's thread, which raises it
                        op.error = self._broken = exc
                op.end_ns = time.perf_counter_ns()
                op.done.set()
                del op

    def close(self) -> None:
        """Stop the thread once the posted collectives have run (after the last step)."""
        self._ops.put(None)
        self._thread.join(timeout=self.timeout_s)


def collective_records(
    records: Sequence[ActionRecord], times: Mapping[int, CollectiveTimes]
) -> tuple[ActionRecord, ...]:
    """``records`` (one per action, in program order) with each posted collective's times as it ran on the
    stream: start and end of its work, and ``host_start_ns`` when the program posted it."""
    return tuple(
        replace(r, start_ns=t.start_ns, end_ns=t.end_ns, host_start_ns=t.posted_ns, host_end_ns=t.posted_ns)
        if (t := times.get(index)) is not None
        else r
        for index, r in enumerate(records)
    )
