"""The channel threads' share of a rank's core, measured by a dedicated micro-bench (issue 36).

``RuntimeCosts.thread_share`` says how much of a message's CPU work (``RuntimeCosts.message_cpu_us``) comes
out of the compute of the rank that handles it. The micro-bench measures it directly, on two processes pinned
to two distinct cores as the ranks of a run are:

1. the measured rank runs a fixed CPU computation in blocks (single-threaded matrix products of about
   ``block_ms``) with nothing else to do: the block's time alone;
2. it runs the same blocks while a thread of its own receives ``messages`` messages of one size from its
   peer, and again while the thread sends them, each through ``irecv``/``isend`` and ``wait`` on the
   default group as a channel thread does (``runtime.comm``);
3. the compute lost per message is the time the blocks inside the messages' window took beyond the same
   number of blocks alone, divided by the messages that window covered.

The loss per message of both ends together, over the message's CPU work as the fitted runtime costs state it,
is the share; at several sizes it is fitted through the origin and held within its physical bounds [0, 1]
(``FittedTerm.clamped`` says when the data asked for more). The same numbers give the slowdown of compute that
runs beside communication (``compute_slowdown``: the blocks' time with messages over alone, less one): on this
placement (a rank, its channel threads and its copies on one core) the two are one effect, which the simulator
charges per message (``RuntimeCosts.posting_us``).
"""

from __future__ import annotations

import datetime
import functools
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octopipe.execute.devices import CPU_BACKEND
from octopipe.execute.processes import free_port
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.simulate import BOUNDS, FittedTerm, RuntimeCosts

__all__ = ["ThreadShareMeasurement", "fit_thread_share", "measure_thread_share"]

_MEASURED, _PEER = 1, 0


@dataclass(frozen=True)
class ThreadShareMeasurement:
    """What ``measure_thread_share`` found: the fitted share and, per message size, what it rests on."""

    share: FittedTerm
    #: bytes -> compute lost per received message plus per sent message, microseconds (medians over repeats)
    loss_us: dict[int, float]
    #: bytes -> the message's CPU work per the runtime costs the share is relative to, microseconds
    message_cpu_us: dict[int, float]
    #: bytes -> the compute blocks' time beside the messages over alone, less one
    compute_slowdown: dict[int, float]
    #: the compute block's time alone, microseconds
    block_us: float
    cores: list[int]

    def as_dict(self) -> dict[str, object]:
        return {
            "thread_share": self.share.as_dict(),
            "loss_us_per_message": {str(k): v for k, v in self.loss_us.items()},
            "message_cpu_us": {str(k): v for k, v in self.message_cpu_us.items()},
            "compute_slowdown_beside_messages": {str(k): v for k, v in self.compute_slowdown.items()},
            "block_us": self.block_us,
            "measured_rank_cores": self.cores,
        }


def fit_thread_share(loss_us: dict[int, float], message_cpu_us: dict[int, float]) -> FittedTerm:
    """The share through the origin, ``loss = share x message_cpu`` by least squares, held within its bounds."""
    sizes = [size for size in loss_us if message_cpu_us.get(size, 0.0) > 0.0]
    if not sizes:
        raise ValueError("the runtime costs give no per-message CPU work: fit them first (runtime_costs)")
    value = sum(loss_us[s] * message_cpu_us[s] for s in sizes) / sum(message_cpu_us[s] ** 2 for s in sizes)
    low, high = BOUNDS["thread_share"]
    held = min(max(value, low), high)
    return FittedTerm("thread_share", held, low, high, clamped=held != value)


def _block(a: torch.Tensor, b: torch.Tensor, repeats: int) -> None:
    for _ in range(repeats):
        torch.mm(a, b)


def _blocks_beside(
    transfer: Callable[[], None], a: torch.Tensor, b: torch.Tensor, repeats: int
) -> tuple[list[tuple[int, int]], int, int]:
    """Run blocks while ``transfer`` runs on a thread; the blocks' (start, end) and the transfer's own span."""
    span: list[int] = []

    def timed() -> None:
        span.append(time.perf_counter_ns())
        transfer()
        span.append(time.perf_counter_ns())

    thread = threading.Thread(target=timed, name="channel", daemon=True)
    blocks = []
    thread.start()
    while thread.is_alive():
        start = time.perf_counter_ns()
        _block(a, b, repeats)
        blocks.append((start, time.perf_counter_ns()))
    thread.join()
    if len(span) != 2:
        raise RuntimeError("the transfer thread failed (see its traceback above)")
    return blocks, span[0], span[1]


def _loss_per_message(
    blocks: list[tuple[int, int]], window: tuple[int, int], alone_ns: float, messages: int
) -> tuple[float, float]:
    """(compute lost per message in us, slowdown) from the blocks wholly inside the messages' window."""
    inside = [(s, e) for s, e in blocks if s >= window[0] and e <= window[1]]
    if not inside:
        raise RuntimeError("no compute block fitted inside the messages' window: give more messages")
    took = sum(e - s for s, e in inside)
    lost = took - len(inside) * alone_ns
    covered = messages * took / (window[1] - window[0])
    return lost / covered / 1e3, took / (len(inside) * alone_ns) - 1


def _exchange(buffer: torch.Tensor, peer: int, receive: bool, messages: int, timeout: datetime.timedelta) -> None:
    """``messages`` receives from (or sends to) ``peer``, each waited for, as a channel thread does them."""
    for _ in range(messages):
        work = dist.irecv(buffer, peer) if receive else dist.isend(buffer, peer)
        assert work is not None  # gloo returns a work for every point-to-point operation
        work.wait(timeout=timeout)


def _worker(
    rank: int, port: int, sizes: Sequence[int], messages: int, block_ms: float, repeats: int, timeout_s: float, out: str
) -> None:
    cores, _ = pin_rank(rank)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        CPU_BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout
    )
    try:
        a, b = torch.randn(160, 160), torch.randn(160, 160)
        # a block of about block_ms on this core
        start = time.perf_counter_ns()
        _block(a, b, 50)
        per_mm = (time.perf_counter_ns() - start) / 50
        mms = max(1, round(block_ms * 1e6 / per_mm))
        lines = []
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32)
            losses: list[tuple[float, float]] = []
            for _ in range(repeats):
                dist.barrier()
                alone = []
                if rank == _MEASURED:
                    for _ in range(12):
                        began = time.perf_counter_ns()
                        _block(a, b, mms)
                        alone.append(time.perf_counter_ns() - began)
                dist.barrier()
                for receive in (True, False):  # the measured rank receives, then sends
                    if rank == _MEASURED:
                        transfer = functools.partial(_exchange, buffer, _PEER, receive, messages, timeout)
                        blocks, first, last = _blocks_beside(transfer, a, b, mms)
                        losses.append(_loss_per_message(blocks, (first, last), statistics.median(alone), messages))
                    else:  # the peer does the other end, on its program's thread
                        _exchange(buffer, _MEASURED, not receive, messages, timeout)
                    dist.barrier()
                if rank == _MEASURED:
                    lines.append(f"alone {statistics.median(alone) / 1e3}")
            if rank == _MEASURED:
                received = statistics.median(loss for loss, _ in losses[0::2])
                sent = statistics.median(loss for loss, _ in losses[1::2])
                slowdown = statistics.median(s for _, s in losses)
                lines.append(f"size {buffer.numel() * 4} {received + sent} {slowdown}")
        if rank == _MEASURED:
            lines.append("cores " + " ".join(str(c) for c in cores))
            Path(out).write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_thread_share(
    runtime: RuntimeCosts,
    *,
    sizes: Sequence[int] = (512 << 10, 4 << 20),
    messages: int = 120,
    block_ms: float = 2.0,
    repeats: int = 3,
    timeout_s: float = 300.0,
) -> ThreadShareMeasurement:
    """Run the micro-bench (module docstring) on two local ranks; the share is relative to ``runtime``'s
    per-message CPU work (``bench/runtime_costs.py``'s fit)."""
    if messages < 10 or repeats < 1 or block_ms <= 0:
        raise ValueError(f"give messages >= 10, repeats >= 1 and block_ms > 0, got {messages}, {repeats}, {block_ms}")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "share.txt")
        context = mp.start_processes(
            _worker,
            args=(free_port(), list(sizes), messages, block_ms, repeats, timeout_s, out),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the thread-share micro-bench did not finish within {timeout_s:.0f} s")
        lines = [line.split() for line in Path(out).read_text().splitlines()]
    block_us = statistics.median(float(line[1]) for line in lines if line[0] == "alone")
    loss = {int(line[1]): float(line[2]) for line in lines if line[0] == "size"}
    slowdown = {int(line[1]): float(line[3]) for line in lines if line[0] == "size"}
    cores = [int(c) for line in lines if line[0] == "cores" for c in line[1:]]
    cpu = {size: runtime.message_cpu_us(size) for size in loss}
    share = fit_thread_share(loss, cpu)
    structlog.get_logger("octopipe.threadshare").info(
        "thread_share_measured", share=round(share.value, 3), clamped=share.clamped, loss_us=loss, cores=cores
    )
    return ThreadShareMeasurement(share, loss, cpu, slowdown, block_us, cores)
