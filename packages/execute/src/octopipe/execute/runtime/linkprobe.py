"""Measure the point-to-point link between two local ranks (gloo on 127.0.0.1, or NCCL between two GPUs).

Two processes, pinned to two distinct cores (as the ranks of a run are),
ping-pong tensors of several sizes on their device (on GPUs, each round trip
waits for the device before the clock is read); half the median round trip is
the one-way time per size. The latency is the smallest size's one-way time (a median of
many round trips, so one slow round trip does not move it); the bandwidth is
the least-squares slope through the origin of (bytes, time above the latency)
over the other sizes. (An intercept fitted through all sizes is dominated by
the noise of the largest transfers: it moved from 22 to 145 us between two
probes of the same machine.)
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octopipe.execute.devices import probe_pairs, rank_device
from octopipe.execute.processes import free_port
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.profile.v1 import profile_pb2
from octopipe.transform.device import Device

__all__ = ["DEFAULT_SIZES", "fit_link", "local_links", "measure_link", "measure_links"]

DEFAULT_SIZES = (4, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


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
    """(latency_us, bandwidth_bytes_per_second) from (bytes, one-way us) points: the smallest size's time
    is the latency, the slope through the origin of the others' time above it the bandwidth."""
    if len(points) < 2:
        raise ValueError("need at least two sizes to fit latency and bandwidth")
    ordered = sorted(points)
    (first_bytes, first_us), rest = ordered[0], ordered[1:]
    xs = [float(b - first_bytes) for b, _ in rest]
    ys = [t - first_us for _, t in rest]
    sxx = sum(x * x for x in xs)
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    bandwidth = 1e6 / slope if slope > 0 else float("inf")
    latency = max(0.0, first_us - first_bytes * max(slope, 0.0))  # the smallest message's time, less its bytes
    return latency, bandwidth


def _worker(
    rank: int, port: int, sizes: Sequence[int], repeats: int, timeout_s: float, out: str, devices: Sequence[str]
) -> None:
    pin_rank(rank)  # two distinct cores where the machine has two, never the inherited mask
    torch.set_num_threads(1)
    device = Device.parse(devices[rank])
    device.activate()
    dist.init_process_group(
        device.backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        lines = []
        for size in sizes:
            buffer = device.put(torch.zeros(max(1, size // 4), dtype=torch.float32))
            samples = []
            rounds = repeats * 4 if size <= 4096 else repeats  # small messages are cheap: many more of them
            for index in range(rounds + 2):
                start = time.perf_counter_ns()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                device.synchronize()  # a GPU's send and receive return when queued: wait for them
                if index >= 2:
                    samples.append((time.perf_counter_ns() - start) / 2000.0)
            lines.append(f"{buffer.numel() * 4} {statistics.median(samples)}")
        if rank == 0:
            Path(out).write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_link(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 25,
    timeout_s: float = 120.0,
    device: str = "cpu",
    pair: tuple[int, int] = (0, 1),
) -> tuple[profile_pb2.LinkCost, list[tuple[int, float]]]:
    """Measure local rank ``pair[0]`` <-> ``pair[1]`` on this machine (``device`` ``cpu``: gloo; ``cuda``:
    NCCL between those two GPUs): the fitted LinkCost (between the pair's ranks) and the (bytes, us)
    points."""
    devices = [rank_device(device, index) for index in pair]
    log = structlog.get_logger("octopipe.linkprobe")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "points.txt")
        port = free_port()
        context = mp.start_processes(
            _worker,
            args=(port, list(sizes), repeats, timeout_s, out, devices),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the link probe did not finish within {timeout_s:.0f} s")
        points = [(int(b), float(t)) for b, t in (line.split() for line in Path(out).read_text().splitlines())]
    latency, bandwidth = fit_link(points)
    log.info(
        "link_measured",
        devices=devices,
        latency_us=round(latency, 1),
        bandwidth_gb_s=round(bandwidth / 1e9, 3),
        sizes=len(points),
    )
    cost = profile_pb2.LinkCost(
        source_rank=pair[0], destination_rank=pair[1], latency_us=latency, bandwidth_bytes_per_second=bandwidth
    )
    return cost, points


def measure_links(num_ranks: int, *, device: str = "cpu", repeats: int = 25) -> list[profile_pb2.LinkCost]:
    """The links between ``num_ranks`` local ranks, both directions of every pair, as a Profile lists them.

    The pairs measured are the device layer's (``devices.probe_pairs``): on CPU one pair stands for all
    (every local pair shares the loopback); on GPUs every pair is measured (NVLink, PCIe or a NIC, each pair
    its own)."""
    measured = {
        pair: measure_link(device=device, pair=pair, repeats=repeats)[0] for pair in probe_pairs(device, num_ranks)
    }
    standing = next(iter(measured.values()))  # a pair not measured is like the first (CPU: all are)
    links = []
    for a in range(num_ranks):
        for b in range(num_ranks):
            if a != b:
                cost = measured.get((min(a, b), max(a, b)), standing)
                links.append(
                    profile_pb2.LinkCost(
                        source_rank=a,
                        destination_rank=b,
                        latency_us=cost.latency_us,
                        bandwidth_bytes_per_second=cost.bandwidth_bytes_per_second,
                    )
                )
    return links
