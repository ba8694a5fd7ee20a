"""Measure the point-to-point link between two local ranks (gloo on 127.0.0.1).

Two processes ping-pong tensors of several sizes; half the median round trip
is the one-way time per size, and a least-squares line through those points
gives the link's latency (intercept) and bandwidth (1 / slope).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octopipe.profile.v1 import profile_pb2

__all__ = ["DEFAULT_SIZES", "fit_link", "free_port", "local_links", "measure_link"]

DEFAULT_SIZES = (4, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def local_links(cost: profile_pb2.LinkCost, num_ranks: int) -> list[profile_pb2.LinkCost]:
    """``cost`` for every ordered pair of ``num_ranks`` local ranks (a ping-pong measures both directions,
    and every pair of processes on one machine shares the same loopback)."""
    return [
        profile_pb2.LinkCost(
            source_rank=a,
            destination_rank=b,
            latency_us=cost.latency_us,
            bandwidth_bytes_per_second=cost.bandwidth_bytes_per_second,
        )
        for a in range(num_ranks)
        for b in range(num_ranks)
        if a != b
    ]


def fit_link(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(latency_us, bandwidth_bytes_per_second) of the line through (bytes, one-way us) points."""
    if len(points) < 2:
        raise ValueError("need at least two sizes to fit latency and bandwidth")
    xs = [float(b) for b, _ in points]
    ys = [t for _, t in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    latency = max(0.0, mean_y - slope * mean_x)
    bandwidth = 1e6 / slope if slope > 0 else float("inf")
    return latency, bandwidth


def _worker(rank: int, port: int, sizes: Sequence[int], repeats: int, timeout_s: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        lines = []
        for size in sizes:
            buffer = torch.zeros(max(1, size // 4), dtype=torch.float32)
            samples = []
            for index in range(repeats + 2):
                start = time.perf_counter_ns()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                if index >= 2:
                    samples.append((time.perf_counter_ns() - start) / 2000.0)
            lines.append(f"{buffer.numel() * 4} {statistics.median(samples)}")
        if rank == 0:
            Path(out).write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_link(
    *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 10, timeout_s: float = 120.0
) -> tuple[profile_pb2.LinkCost, list[tuple[int, float]]]:
    """Measure rank 0 <-> rank 1 over gloo on this machine: the fitted LinkCost and the (bytes, us) points."""
    log = structlog.get_logger("octopipe.linkprobe")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "points.txt")
        port = free_port()
        context = mp.start_processes(
            _worker, args=(port, list(sizes), repeats, timeout_s, out), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the link probe did not finish within {timeout_s:.0f} s")
        points = [(int(b), float(t)) for b, t in (line.split() for line in Path(out).read_text().splitlines())]
    latency, bandwidth = fit_link(points)
    log.info("link_measured", latency_us=round(latency, 1), bandwidth_gb_s=round(bandwidth / 1e9, 3), sizes=len(points))
    cost = profile_pb2.LinkCost(
        source_rank=0, destination_rank=1, latency_us=latency, bandwidth_bytes_per_second=bandwidth
    )
    return cost, points
