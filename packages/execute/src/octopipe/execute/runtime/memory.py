"""Peak memory as the allocator saw it: not the runtime's own count of the tensors it holds.

A rank's peak over a pipeline step is

    resident bytes at the step's start  +  the allocator's peak over the step above that start.

The second term comes from torch's CPU allocator, through the profiler's memory
events (``profile_memory=True``): every allocation and free of every tensor the
step's main thread creates -- saved activations, intermediate buffers inside a
graph, gradients, sends' contiguous copies, receive buffers -- whether or not
octopipe tracks it. The first term is the bytes of the tensors alive when the
step starts that the rank holds for the step: parameters, buffers and
optimizer state, counted from those tensors' storages (each storage once),
never from the simulator's numbers. On CUDA the same quantity is ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``.

Limits. Allocations made by other threads (the channel threads allocate
nothing; gloo's own staging buffers are not torch allocations) are not seen.
Frees of tensors allocated before the window are not reported by the profiler,
so a window must start where nothing older is freed inside it (a step after
``zero_grad(set_to_none=True)``). The profiler slows the step it watches: time
is measured on other steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from octopipe.transform import AllocatorPeak

__all__ = ["AllocatorPeak", "MemoryMeasurement", "resident_bytes"]


@dataclass(frozen=True, slots=True)
class MemoryMeasurement:
    """One rank's allocator-measured memory over one step, in bytes."""

    #: bytes of the tensors held when the step started (parameters, buffers, optimizer state)
    resident_bytes: int
    #: the allocator's peak over the step, above what was allocated when it started
    step_peak_bytes: int
    #: allocated at the step's end minus at its start (what the step left behind)
    step_end_bytes: int
    #: allocations seen
    allocations: int

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.step_peak_bytes

    def as_json(self) -> dict[str, int]:
        return {
            "resident_bytes": self.resident_bytes,
            "step_peak_bytes": self.step_peak_bytes,
            "step_end_bytes": self.step_end_bytes,
            "peak_bytes": self.peak_bytes,
            "allocations": self.allocations,
        }


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages count once)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
