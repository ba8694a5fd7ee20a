"""Which device each rank of a run gets, decided before any rank starts, without torch.

A run asks for ``cpu`` (every rank on the CPU, gloo) or ``cuda`` (local rank r
on GPU r of its machine, NCCL: the torchrun convention of ``LOCAL_RANK`` and
``CUDA_VISIBLE_DEVICES``). NCCL refuses two ranks on one GPU, so a machine must
have a GPU per rank it runs: :func:`gpu_problem` says so in one line, naming
what to change. The node daemon learns its GPUs without torch from
``nvidia-smi`` (:func:`probe_gpus`). The torch side of a device (moving
tensors, the backend, the allocator) is ``octopipe.transform.Device``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

__all__ = [
    "CPU_BACKEND",
    "RUN_DEVICES",
    "Gpu",
    "backend_device",
    "backend_for",
    "backend_problem",
    "capacity",
    "device_memory_budget",
    "gpu_problem",
    "is_gpu",
    "probe_gpus",
    "probe_pairs",
    "rank_device",
    "submission_problem",
]

#: what a run may ask for
RUN_DEVICES = ("cpu", "cuda")
#: the process-group backend of CPU ranks (a push names its backend; GPU ranks use nccl)
CPU_BACKEND = "gloo"
_BACKENDS = {CPU_BACKEND: "cpu", "nccl": "cuda"}


def is_gpu(kind: str) -> bool:
    """Whether a node's reported device (its ``kind``) is a GPU rather than a CPU slot."""
    return kind != "cpu"


@dataclass(frozen=True)
class Gpu:
    """One GPU of a machine, as a node reports it."""

    index: int
    name: str
    memory_bytes: int


def rank_device(kind: str, local_rank: int) -> str:
    """The device of the rank with index ``local_rank`` on its machine: ``cpu``, or ``cuda:<local_rank>``."""
    if kind not in RUN_DEVICES:
        raise ValueError(f"device must be one of {', '.join(RUN_DEVICES)}, got {kind!r}")
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    return "cpu" if kind == "cpu" else f"cuda:{local_rank}"


def probe_pairs(kind: str, num_ranks: int) -> list[tuple[int, int]]:
    """Which pairs of local ranks a link probe measures: on CPU one pair stands for all (every local pair
    shares the loopback); on GPUs every pair (NVLink, PCIe or a NIC: each pair its own link)."""
    if num_ranks < 2:
        raise ValueError(f"a link needs two ranks, got {num_ranks}")
    if kind == "cpu":
        return [(0, 1)]
    return [(a, b) for a in range(num_ranks) for b in range(a + 1, num_ranks)]


def gpu_problem(kind: str, ranks_here: int, gpus_here: int, *, where: str = "this machine") -> str:
    """Why ``ranks_here`` ranks of a ``kind`` run cannot run on a machine with ``gpus_here`` GPUs ('' if they
    can)."""
    if kind != "cuda":
        return ""
    if gpus_here == 0:
        return f"device cuda: {where} has no GPU that CUDA can use: run with device cpu, or on a machine with GPUs"
    if ranks_here > gpus_here:
        return (
            f"device cuda: the plan puts {ranks_here} ranks on {where}, which has {gpus_here} GPU(s), and NCCL "
            f"refuses two ranks on one GPU: tune the plan for {gpus_here} rank(s) per machine, or add machines"
        )
    return ""


def backend_device(backend: str) -> str:
    """The run device (``cpu`` or ``cuda``) of a push's backend (empty: the CPU's)."""
    kind = _BACKENDS.get(backend or CPU_BACKEND)
    if kind is None:
        raise ValueError(f"backend {backend!r} is not known: use {' or '.join(_BACKENDS)}")
    return kind


def backend_for(kind: str) -> str:
    """The process-group backend of ranks on ``kind`` devices ('' is the CPU)."""
    kind = kind or "cpu"
    backend = next((b for b, k in _BACKENDS.items() if k == kind), None)
    if backend is None:
        raise ValueError(f"device must be one of {', '.join(RUN_DEVICES)}, got {kind!r}")
    return backend


def capacity(kind: str, slots: int, gpus: int) -> int:
    """How many ranks of a ``kind`` run a node with ``slots`` slots and ``gpus`` GPUs takes ('' is the CPU)."""
    return min(slots, gpus) if is_gpu(kind or "cpu") else slots


def submission_problem(kind: str) -> str:
    """Why a run on ``kind`` cannot be submitted ('' when it can): an unknown device. (Whether its ranks fit
    the nodes' GPUs is the scheduler's to say: a run waits for GPU slots, and a node refuses a push it
    cannot run.)"""
    if (kind or "cpu") not in RUN_DEVICES:
        return f"device {kind!r} is not known: use {' or '.join(RUN_DEVICES)}"
    return ""


def backend_problem(backend: str, ranks_here: int, gpus_here: int, *, where: str = "this machine") -> str:
    """Why a node cannot run ``ranks_here`` ranks of a run on ``backend`` ('' if it can); an empty backend is
    the CPU's."""
    try:
        kind = backend_device(backend)
    except ValueError as exc:
        return str(exc)
    return gpu_problem(kind, ranks_here, gpus_here, where=where)


def probe_gpus(timeout_s: float = 10.0) -> list[Gpu]:
    """The machine's GPUs from ``nvidia-smi`` (no torch, no CUDA context); empty where there is none or the
    tool is missing. ``CUDA_VISIBLE_DEVICES`` (a list of indices) narrows them as CUDA would."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        listed = subprocess.run(
            [tool, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in listed.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit() and fields[2].isdigit():
            gpus.append(Gpu(index=int(fields[0]), name=fields[1], memory_bytes=int(fields[2]) * 2**20))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        order = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        by_index = {g.index: g for g in gpus}
        gpus = [Gpu(i, by_index[v].name, by_index[v].memory_bytes) for i, v in enumerate(order) if v in by_index]
    return gpus


def device_memory_budget(device: str, ranks: int, reserve: float) -> tuple[int, str]:
    """Bytes per rank a plan may use on this machine, and how they were found: on ``cuda``, the smallest
    visible GPU's memory; on ``cpu``, the host's physical memory shared by ``ranks`` local ranks; either
    less the ``reserve`` fraction (for the framework, the allocator's fragmentation, other processes)."""
    if not 0.0 <= reserve < 1.0:
        raise ValueError(f"the memory reserve is a fraction in [0, 1), e.g. 0.1, got {reserve}")
    if device == "cuda":
        gpus = probe_gpus()
        if not gpus:
            raise ValueError("no GPU is visible to read a memory budget from: give --memory-budget SIZE, e.g. 80GiB")
        total, where = min(g.memory_bytes for g in gpus), f"GPU memory {min(g.memory_bytes for g in gpus)} bytes"
    elif device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks)
        where = f"host memory shared by {ranks} local ranks, {total} bytes each"
    else:
        raise ValueError(f"device {device!r}: a memory budget is read from cpu or cuda")
    budget = int(total * (1.0 - reserve))
    return budget, f"{where}, less a {reserve:.0%} reserve"
