"""How the C library keeps freed host memory: the largest single cost a CPU rank pays that eager torch hides.

torch's CPU allocator is the C library's ``malloc``. glibc serves a block
above its *mmap threshold* (128 KiB at start, raised on the fly up to 32 MiB as
blocks are freed) with a fresh ``mmap``, and gives memory at the top of its heap
back to the kernel once more than the *trim threshold* is free there. Every
page of a fresh mapping faults on first touch and is zeroed by the kernel. A
pipeline stage allocates and frees activations and gradients of megabytes
every action, so whether a block is reused or mapped afresh decides a large
part of its time: on one core, a Mamba block's backward at the standard sizes
took 72.7 ms with 20 480 page faults under glibc's defaults and 37.2 ms with
none once freed memory was kept (``bench/runtime_overhead.py``). Which blocks
fault depends on the order of earlier allocations, so the same layer timed
alone, inside octopipe's pipeline, or inside torch's ran at different speeds.

``configure_host_memory("reuse")`` fixes both thresholds
(``mallopt(M_MMAP_THRESHOLD, 32 MiB)``, the most glibc accepts, and
``mallopt(M_TRIM_THRESHOLD, 1 GiB)``): blocks up to 32 MiB come from the heap
and freed ones are reused, as a caching allocator would. The cost: memory a
rank freed stays mapped to it (its resident set stays near its peak; the
allocator peak the runtime reports is unchanged). ``"system"`` leaves the C
library as it is. The heap reaches its steady size only once it has held a
step's peak in the order the step allocates it: one step for 1F1B's ranks, and
up to three for ZB-H1's at the standard jamba-8 sizes, whose stashed W inputs
raise the peak (a rank faulted 105k, 19k, 19k, then 0 pages per step); runs of
a few steps should leave those out. It acts on the whole process and only on glibc (elsewhere it
reports that it did nothing); the runtime's rank processes and the profiler
apply the same policy, so layers are timed under the allocator they run with.
CUDA memory is untouched (torch's caching allocator already reuses it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Literal

__all__ = ["HOST_MEMORY_POLICIES", "HostMemory", "HostMemoryState", "configure_host_memory", "host_memory_policy"]

HostMemory = Literal["reuse", "system"]
#: the policies a run may name
HOST_MEMORY_POLICIES: tuple[HostMemory, ...] = ("reuse", "system")

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit machines (half its 64 MiB heap size)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@dataclass(frozen=True)
class HostMemoryState:
    """What :func:`configure_host_memory` did: the policy asked for, whether it took effect, and why not."""

    policy: HostMemory
    applied: bool
    mmap_threshold_bytes: int = 0
    trim_threshold_bytes: int = 0
    reason: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "applied": self.applied,
            "mmap_threshold_bytes": self.mmap_threshold_bytes,
            "trim_threshold_bytes": self.trim_threshold_bytes,
            "reason": self.reason,
        }


def host_memory_policy(name: str) -> HostMemory:
    """``name`` as a :data:`HostMemory` policy; ValueError naming the choices otherwise."""
    for policy in HOST_MEMORY_POLICIES:
        if name == policy:
            return policy
    raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORY_POLICIES)}, got {name!r}")


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def configure_host_memory(policy: str = "reuse") -> HostMemoryState:
    """Apply ``policy`` to this process's C allocator (see the module docstring) and say what happened.

    Call it once at a process's start, before the work it should govern; calling it again is harmless."""
    chosen = host_memory_policy(policy)
    if chosen == "system":
        return HostMemoryState(policy=chosen, applied=False, reason="the C library's defaults, as asked")
    libc = _glibc()
    if libc is None:
        return HostMemoryState(policy=chosen, applied=False, reason="not glibc: its allocator is left as it is")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return HostMemoryState(policy=chosen, applied=False, reason="glibc refused the mmap threshold")
    if not libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        return HostMemoryState(policy=chosen, applied=False, reason="glibc refused the trim threshold")
    return HostMemoryState(
        policy=chosen,
        applied=True,
        mmap_threshold_bytes=MMAP_THRESHOLD_BYTES,
        trim_threshold_bytes=TRIM_THRESHOLD_BYTES,
    )
