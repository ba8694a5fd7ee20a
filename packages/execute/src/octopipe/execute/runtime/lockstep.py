"""Profiling as the pipeline runs: one profiler per rank, each pinned to its rank's core, timing in lock-step.

A layer timed alone (the other cores idle) runs at another speed than inside a
pipeline, where every rank computes at once on its own core and they share the
memory bus and the last-level cache (``bench/profile_conditions.py`` measured it:
nemotronh-16's steps were under-predicted by 10-12% from a profile taken alone,
3-8% from one taken beside a computing neighbour). :func:`profile_in_lockstep`
profiles under that condition:

- one process per rank, each pinned to the core that rank ``r`` of a local run
  takes (``pinning.pin_rank``), on one thread, with the runtime's allocator
  policy, as each rank runs;
- every process profiles the same layers, and a barrier starts each timed sample
  in all of them together (``ProfilerConfig.before_sample``), so that every
  sample runs beside the others' compute;
- the Profile holds, per layer and action, the median over the processes of their
  medians; its ``conditions`` label says how it was taken.

It refuses more ranks than online cores: ranks that share a core would time each
other's work, which is not what a layer costs.
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
import traceback
from multiprocessing.synchronize import Barrier
from typing import Any

from octopipe.execute.runtime.linkprobe import local_links
from octopipe.execute.runtime.pinning import online_cpus, pin_rank
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2

__all__ = ["LOCKSTEP_TIMED_FIELDS", "merge_lockstep", "profile_in_lockstep"]

#: the per-layer times each process measures; every other field is the same in all of them (sizes, shapes)
LOCKSTEP_TIMED_FIELDS = (
    "forward_duration_us",
    "backward_input_duration_us",
    "backward_weight_duration_us",
    "full_backward_duration_us",
)


def _profile_rank(
    rank: int,
    cores: list[int],
    barrier: Barrier,
    results: multiprocessing.Queue[tuple[int, bytes, str]],
    reference: bytes,
    options: dict[str, Any],
) -> None:
    """One rank's profiler (a spawned process): pinned, then the layers profiled, each sample at the barrier."""
    try:
        pinned, warning = pin_rank(rank, cores)
        if warning:
            raise RuntimeError(warning)  # not on its own core: its times would not be this condition's
        model = plan_pb2.ModelReference.FromString(reference)
        profile = profile_reference(model, before_sample=barrier.wait, **options)
        profile.labels["core"] = ",".join(map(str, pinned))
        results.put((rank, profile.SerializeToString(), ""))
    except BaseException:  # reported to the parent, which names the rank; the barrier lets the others go
        barrier.abort()
        results.put((rank, b"", traceback.format_exc()))


def merge_lockstep(profiles: list[profile_pb2.Profile]) -> profile_pb2.Profile:
    """One Profile from the processes' profiles of the same layers: each timed field the median over them."""
    if not profiles:
        raise ValueError("no profiles to merge")
    names = [[layer.layer_name for layer in p.layers] for p in profiles]
    if any(n != names[0] for n in names):
        raise ValueError(f"the lock-step profiles hold different layers: {names}")
    merged = profile_pb2.Profile()
    merged.CopyFrom(profiles[0])
    for index, layer in enumerate(merged.layers):
        for field in LOCKSTEP_TIMED_FIELDS:
            if field == "full_backward_duration_us" and not layer.HasField("full_backward_duration_us"):
                continue
            setattr(layer, field, statistics.median(getattr(p.layers[index], field) for p in profiles))
    return merged


def profile_in_lockstep(
    reference: plan_pb2.ModelReference,
    *,
    num_microbatches: int,
    num_ranks: int = 2,
    link: profile_pb2.LinkCost | None = None,
    repeats: int = 5,
    seed: int = 0,
    precision: str = "",
    timeout_s: float = 1800.0,
) -> profile_pb2.Profile:
    """Profile the layers of ``reference`` in ``num_ranks`` pinned processes whose samples run together.

    The arguments are :func:`~octopipe.execute.runtime.pipeline.profile_reference`'s (CPU only: a CUDA rank has
    its own device, and its neighbours do not share it). ``timeout_s``: how long the processes may take, all
    together; past it they are stopped and this raises ``TimeoutError``."""
    cores = online_cpus()
    if num_ranks < 2:
        raise ValueError(f"a lock-step profile needs num_ranks >= 2 (one process per rank), got {num_ranks}")
    if num_ranks > len(cores):
        raise ValueError(
            f"a lock-step profile of {num_ranks} ranks needs {num_ranks} online cores, this machine has "
            f"{len(cores)} ({cores}): ranks sharing a core would time each other's work; use num_ranks <= "
            f"{len(cores)} or profile_reference"
        )
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_ranks, timeout=timeout_s)
    results: multiprocessing.Queue[tuple[int, bytes, str]] = context.Queue()
    options: dict[str, Any] = {"num_microbatches": num_microbatches, "num_ranks": num_ranks, "repeats": repeats}
    options.update(seed=seed, precision=precision)
    processes = [
        context.Process(
            target=_profile_rank,
            args=(rank, cores, barrier, results, reference.SerializeToString(), options),
            name=f"octopipe-lockstep-profiler-{rank}",
        )
        for rank in range(num_ranks)
    ]
    for process in processes:
        process.start()
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < num_ranks:
            try:
                rank, data, error = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if r not in got and p.exitcode not in (None, 0)]
                if dead:  # died without a word (a signal): the others would wait at the barrier
                    raise RuntimeError(
                        f"lock-step profiler of rank {dead[0]} exited with code {processes[dead[0]].exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the lock-step profilers returned {len(got)} of {num_ranks} profiles in {timeout_s:.0f} s"
                    ) from None
                continue
            if error:
                raise RuntimeError(f"lock-step profiler of rank {rank} failed:\n{error}")
            got[rank] = data
    finally:
        for process in processes:
            process.join(timeout=30.0 if len(got) == num_ranks else 1.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=30.0)
    profiles = [profile_pb2.Profile.FromString(got[r]) for r in range(num_ranks)]
    merged = merge_lockstep(profiles)
    merged.labels["core"] = ",".join(p.labels["core"] for p in profiles)
    merged.labels["conditions"] = (
        f"lockstep: {num_ranks} processes pinned to cores {merged.labels['core']}, each timed sample started "
        "in all of them together; per layer and action the median over them"
    )
    if link is not None:
        del merged.links[:]
        merged.links.extend(local_links(link, num_ranks))
    return merged
