"""Where a rank computes: the one place in octopipe that knows CPU from CUDA.

Everything that depends on the device asks a :class:`Device`: the torch device
tensors and modules go to (``put``), the process group's backend (gloo on CPU,
NCCL on CUDA), the allocator's window for measured memory (the profiler's
memory events on CPU, ``max_memory_allocated`` on CUDA), making the device
current for the process, and waiting for it before a measurement is read. No
other module branches on the device (``tests/execute/test_device_layer.py``
checks the source tree for it).

``Device.parse("cuda:1")`` names a device; ``Device.check()`` says in one line
why it cannot be used on this machine (no CUDA, an index past the GPUs there
are), before anything runs on it. :func:`visible_gpus` lists what torch sees.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from octopipe.transform.allocator import AllocatorPeak, CudaAllocatorPeak

__all__ = ["CPU", "Device", "DeviceError", "GpuInfo", "Stopwatch", "visible_gpus"]

_Movable = TypeVar("_Movable", torch.Tensor, torch.nn.Module)

DeviceKind = Literal["cpu", "cuda"]


class DeviceError(ValueError):
    """A device that cannot be used here: the message says why and what to change, in one line."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as torch sees it."""

    index: int
    name: str
    memory_bytes: int


def visible_gpus() -> list[GpuInfo]:
    """The GPUs this process can use (``CUDA_VISIBLE_DEVICES`` applies); empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(GpuInfo(index=index, name=props.name, memory_bytes=int(props.total_memory)))
    return found


class Stopwatch:
    """Times of the work a process queues on its device, marked as it is queued.

    ``mark()`` returns the host clock (``time.perf_counter_ns``) now and, on
    CUDA, records an event on the current stream behind the work queued so far.
    ``device_ns()`` gives each mark's time on the device's clock, in the host
    clock's nanoseconds: on CPU the host times themselves (the work is done when
    it returns); on CUDA the first mark's host time plus each event's elapsed
    time since the first event (CUDA-event timing, not host clocks). Reading
    them waits for the last event: call it once, after the measured work was
    queued (it is the one synchronization a measured step makes).
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.host: list[int] = []
        self._events: list[torch.cuda.Event] = []

    def mark(self) -> int:
        now = time.perf_counter_ns()
        if self.device.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        self.host.append(now)
        return now

    def device_ns(self) -> list[int]:
        """Every mark's device time, in mark order (CUDA: waits for the last mark's event)."""
        if not self._events:
            return list(self.host)
        first, last = self._events[0], self._events[-1]
        last.synchronize()
        return [self.host[0] + round(first.elapsed_time(e) * 1e6) for e in self._events]

    def elapsed_us(self, start: int, end: int) -> float:
        """Microseconds on the device between mark ``start`` and mark ``end`` (indices)."""
        times = self.device_ns()
        return (times[end] - times[start]) / 1000.0


@dataclass(frozen=True)
class Device:
    """A rank's device: ``cpu``, or ``cuda`` with the index of its GPU among the visible ones."""

    kind: DeviceKind = "cpu"
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda"):
            raise DeviceError(f"device kind {self.kind!r} is not known: use cpu or cuda")
        if self.index < 0 or (self.kind == "cpu" and self.index != 0):
            raise DeviceError(f"device index {self.index} is not allowed for {self.kind}")

    @classmethod
    def parse(cls, text: str) -> Device:
        """``cpu``, ``cuda`` (GPU 0) or ``cuda:N``."""
        kind, _, index = text.strip().partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
            raise DeviceError(f"device {text!r} is not cpu, cuda or cuda:N")
        return cls(kind, int(index) if index else 0)  # type: ignore[arg-type]  # kind checked above

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(str(self))

    @property
    def backend(self) -> Literal["gloo", "cpu:gloo,cuda:nccl"]:
        """The process-group backend for ranks on this kind of device: gloo on CPU; on CUDA NCCL for CUDA
        tensors and gloo for any CPU tensor a collective is given (a flag, a size), so both work."""
        return "cpu:gloo,cuda:nccl" if self.is_cuda else "gloo"

    def check(self) -> None:
        """Raise :class:`DeviceError` (one line) if this machine cannot run on the device."""
        if not self.is_cuda:
            return
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {self}: this machine has no usable CUDA device (torch {torch.__version__}, "
                f"torch.cuda.is_available() is false): run on cpu"
            )
        count = torch.cuda.device_count()
        if self.index >= count:
            raise DeviceError(f"device {self}: this machine shows {count} GPU(s) (cuda:0 to cuda:{count - 1})")

    def make_deterministic(self) -> None:
        """Use torch's deterministic kernels in this process (CUDA: also cuBLAS's fixed workspace, set before
        the first cuBLAS call), so two runs, or a run and its eager reference, compute bitwise alike. Some
        CUDA kernels (index_add, embedding backward) otherwise sum in an order that changes run to run."""
        if self.is_cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    def activate(self) -> None:
        """Make the device current for this process (CUDA: ``set_device``, so NCCL and kernels use it)."""
        self.check()
        if self.is_cuda:
            torch.cuda.set_device(self.index)

    def put(self, value: _Movable) -> _Movable:
        """A tensor (or a module, in place) on this device; already there: itself."""
        return value.to(self.torch_device)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def synchronize(self) -> None:
        """Wait for the work queued on the device (only where a measurement must read a finished result)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.index)

    @property
    def timing(self) -> str:
        """What times the work queued on this device (:class:`Stopwatch`): ``host clock`` or ``cuda events``."""
        return "cuda events" if self.is_cuda else "host clock"

    def stopwatch(self) -> Stopwatch:
        """A :class:`Stopwatch` for the work this process queues on the device."""
        return Stopwatch(self)

    def memory_window(self) -> AllocatorPeak | CudaAllocatorPeak:
        """``with device.memory_window() as meter:``, then ``meter.peak_bytes`` / ``end_bytes`` above the start."""
        return CudaAllocatorPeak(self.index) if self.is_cuda else AllocatorPeak()

    @contextmanager
    def current(self) -> Iterator[Device]:
        """Run a block with this device current (CUDA); CPU: nothing to do."""
        if not self.is_cuda:
            yield self
            return
        with torch.cuda.device(self.index):
            yield self


#: the device every rank used before there was a choice
CPU = Device()
