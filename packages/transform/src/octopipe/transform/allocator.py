"""The allocator's view of memory: peak and net bytes allocated over a window of code.

On CPU, torch's profiler memory events (``profile_memory=True``): every
allocation and free the window's thread makes through torch's CPU allocator,
summed in time order. On CUDA, ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``. Used by the layer profiler (each action's scratch)
and by the runtime (a pipeline step's peak, octopipe.execute.runtime.memory).

Limits: allocations by other threads are not seen; frees of tensors allocated
before the window are not reported (the window must not free older tensors to
be exact); the profiler slows the code it watches, so nothing timed runs in a
window.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocatorPeak", "CudaAllocatorPeak"]


class AllocatorPeak:
    """``with AllocatorPeak() as meter: ...`` then ``meter.peak_bytes`` / ``meter.end_bytes`` (above the start):
    CPU allocations, from the profiler's memory events summed in time order. ``Device.memory_window()`` picks
    this or :class:`CudaAllocatorPeak` for a rank's device."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.end_bytes = 0
        self.allocations = 0
        self._profile: profile | None = None

    def __enter__(self) -> AllocatorPeak:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._profile.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._profile is not None
        self._profile.__exit__(kind, error, trace)
        if kind is not None:
            return
        results = self._profile.profiler.kineto_results if self._profile.profiler is not None else None
        assert results is not None, "the profiler recorded nothing"
        changes = sorted(
            (event.start_ns(), event.nbytes())  # type: ignore[attr-defined]  # in torch, missing from its stubs
            for event in results.events()
            if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
        )
        total = peak = 0
        for _, nbytes in changes:
            total += nbytes
            peak = max(peak, total)
            self.allocations += nbytes > 0
        self.peak_bytes, self.end_bytes = peak, total


class CudaAllocatorPeak:
    """The same window on one GPU: ``torch.cuda.max_memory_allocated`` above the start, after
    ``reset_peak_memory_stats``; the window waits for the GPU at both ends (it measures, so it may).
    ``allocations`` is the allocator's count of allocations made in the window."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.peak_bytes = 0
        self.end_bytes = 0
        self.allocations = 0
        self._start = 0
        self._count = 0

    def __enter__(self) -> CudaAllocatorPeak:
        torch.cuda.synchronize(self.index)
        torch.cuda.reset_peak_memory_stats(self.index)
        self._start = torch.cuda.memory_allocated(self.index)
        self._count = int(torch.cuda.memory_stats(self.index).get("allocation.all.allocated", 0))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        torch.cuda.synchronize(self.index)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.index) - self._start
        self.end_bytes = torch.cuda.memory_allocated(self.index) - self._start
        self.allocations = int(torch.cuda.memory_stats(self.index).get("allocation.all.allocated", 0)) - self._count
