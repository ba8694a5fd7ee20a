"""Run a function on real gloo ranks (spawned processes on 127.0.0.1), with timeouts everywhere.

``run_ranks(fn, world, *args)`` spawns ``world`` processes, each running
``fn(rank, world, *args)`` inside an initialised gloo process group (one
thread per rank). A failure in any rank fails the test with that rank's
traceback; a rank that hangs is killed after ``timeout_s``.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: every collective and the rendezvous give up after this long
COLLECTIVE_TIMEOUT_S = 60


def default_group() -> dist.ProcessGroup:
    """The default process group (inside ``run_ranks``)."""
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup), "call this inside run_ranks"
    return group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # Everything this rank checks has passed. Leave without interpreter finalization: with torch 2.13,
    # gloo work still referenced from Python objects (FSDP2's state in the eager reference) can abort
    # the finalization about once in 15 runs (SIGABRT, "terminate called without an active exception",
    # no Python frame; pytorch/pytorch#179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 180.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any fails or the run exceeds ``timeout_s``."""
    context = mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the {world} ranks did not finish within {timeout_s} s (killed)")
