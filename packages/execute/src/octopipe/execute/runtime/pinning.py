"""Which core each rank runs on: from the machine's online CPUs, never from an inherited mask.

A rank process inherits its parent's CPU mask. A parent pinned to one core (a
benchmark that pins itself, a shell under ``taskset``) would put every rank on
that core, and every rank would then time-share it: two "2-rank" ranks on one
core measured about twice as slow (issue 15). So the cores come from the
machine: ``/sys/devices/system/cpu/online`` (else ``os.cpu_count()``), or an
explicit list; rank r takes ``cores[r % len(cores)]``. Where the container does
not allow a core (``sched_setaffinity`` refuses it), the rank falls back to the
cores it is allowed, and says so. :func:`shared_cores` tells a launcher when
ranks must share cores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["online_cpus", "pin_rank", "shared_cores"]


def online_cpus() -> list[int]:
    """The machine's online CPUs (Linux ``/sys/devices/system/cpu/online``), else 0..cpu_count-1."""
    try:
        text = Path("/sys/devices/system/cpu/online").read_text().strip()
    except OSError:
        return list(range(os.cpu_count() or 1))
    cpus: list[int] = []
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            cpus.extend(range(int(low), int(high) + 1))
        elif part:
            cpus.append(int(part))
    return cpus or list(range(os.cpu_count() or 1))


def pin_rank(rank: int, cpus: Sequence[int] = ()) -> tuple[list[int], str]:
    """Pin this process (rank ``rank``) to one core; return the cores it runs on and a warning ('' if none)."""
    if not hasattr(os, "sched_setaffinity"):
        return [], "this platform cannot pin processes to cores"
    cores = list(cpus) or online_cpus()
    core = cores[rank % len(cores)]
    try:
        os.sched_setaffinity(0, {core})
    except OSError as exc:  # a core outside the container's cpuset
        allowed = sorted(os.sched_getaffinity(0))
        fallback = allowed[rank % len(allowed)]
        os.sched_setaffinity(0, {fallback})
        return [fallback], f"core {core} is not allowed here ({exc.strerror}): rank {rank} runs on core {fallback}"
    return sorted(os.sched_getaffinity(0)), ""


def shared_cores(num_ranks: int, cpus: Sequence[int] = ()) -> str:
    """Why ``num_ranks`` local ranks cannot each have a core of their own ('' when they can)."""
    cores = list(cpus) or online_cpus()
    if num_ranks > len(cores):
        return (
            f"{num_ranks} ranks on {len(cores)} cores ({cores}): ranks share cores, so their times include "
            "waiting for each other; measured step times are not those of one core per rank"
        )
    return ""
