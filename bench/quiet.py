"""What every timing benchmark records and checks: a quiet machine, and where each rank ran.

A figure taken while something else runs is not a result: ``require_quiet``
refuses to start when the 1-minute load average is above a threshold (unless
told to go on, and then the JSON says so), and ``Environment`` records the
load before and after and the cores each rank of each run reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from octopipe.execute.runtime.pinning import online_cpus

__all__ = [
    "Environment",
    "HostCpu",
    "add_arguments",
    "distinct_cores",
    "percentile",
    "require_quiet",
    "start",
    "step_summary",
    "write_record",
]

#: 1-minute load average above which a timing benchmark does not start (a quiet 2-core machine sits near 0.1-0.5)
DEFAULT_MAX_LOAD = 0.8


def require_quiet(max_load: float = DEFAULT_MAX_LOAD, *, force: bool = False) -> tuple[float, float, float]:
    """The load average now; SystemExit when the 1-minute load is above ``max_load`` and not ``force``."""
    load = os.getloadavg()
    if load[0] > max_load and not force:
        raise SystemExit(
            f"load average {load[0]:.2f} is above {max_load}: something else is running (a test suite, a helper, "
            "another benchmark). Stop it and wait a minute, or pass --force (the JSON then says the machine was busy)."
        )
    return load


def distinct_cores(cores: dict[int, list[int]]) -> bool:
    """Whether every rank ran on its own single core, none shared."""
    singles = [tuple(c) for c in cores.values()]
    return all(len(c) == 1 for c in singles) and len(set(singles)) == len(singles)


@dataclass
class Environment:
    """The machine a benchmark ran on: load before/after, online CPUs, each run's rank cores."""

    forced: bool = False
    load_before: tuple[float, float, float] = field(default_factory=os.getloadavg)
    load_after: tuple[float, float, float] | None = None
    runs: list[dict[int, list[int]]] = field(default_factory=list)
    #: what each octopipe launch's host allocator policy did, per rank (``RunResult.host_memory``)
    host_memory: list[dict[str, Any]] = field(default_factory=list)

    def record(self, cores: dict[int, list[int]]) -> None:
        """One run's rank -> cores; a run whose ranks shared a core is an error (the figure would be wrong)."""
        if not distinct_cores(cores):
            raise SystemExit(f"ranks did not run on distinct single cores: {cores}")
        self.runs.append({int(r): list(c) for r, c in cores.items()})

    def finish(self) -> dict[str, Any]:
        self.load_after = os.getloadavg()
        return {
            "machine": platform.processor() or platform.machine(),
            "cpu": cpu_model(),
            "online_cpus": online_cpus(),
            "load_average_before": list(self.load_before),
            "load_average_after": list(self.load_after),
            "forced_while_busy": self.forced,
            "rank_cores_per_run": self.runs,
            "host_memory_per_run": self.host_memory,
        }


def cpu_model() -> dict[str, str]:
    """The host's CPU model and cache sizes (from ``lscpu``; empty where it is missing): figures taken on
    different hosts differ, and the JSON must say which host gave them."""
    wanted = ("Model name", "Vendor ID", "L1d cache", "L2 cache", "L3 cache", "Hypervisor vendor")
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key: found[key].strip() for key in wanted if key in found}


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core so far, from /proc/stat's first line; (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class HostCpu:
    """How busy this machine's cores were, sampled every ``period_s`` on a thread while a benchmark runs, so
    a figure can say whether the host itself was the bottleneck (emulated ranks time-share its cores).
    Samples are (``time.perf_counter_ns``, busy ticks, total ticks); ``busy(start_ns, end_ns)`` is the busy share of all
    cores between the samples that bracket the window (None when the window holds fewer than two)."""

    period_s: float = 0.05
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HostCpu:
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter_ns(), *_cpu_ticks()))  # the runtime's records' clock
            self._stop.wait(self.period_s)

    def busy(self, start_ns: int, end_ns: int) -> float | None:
        inside = [s for s in self.samples if start_ns <= s[0] <= end_ns]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def add_arguments(parser: argparse.ArgumentParser, *, rounds: int, steps: int, warmup: bool = False) -> None:
    """The options every timing benchmark shares: rounds, steps, --tiny, --max-load, --force (and --warmup)."""
    parser.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    parser.add_argument("--steps", type=int, default=steps, help="steps per launch, the warm-up steps included")
    if warmup:
        parser.add_argument(
            "--warmup",
            type=int,
            default=1,
            help="the first steps of every launch left out of the figures, for every candidate alike (default 1; a "
            "plan that holds more activations takes more steps to reach the allocator's steady state)",
        )
    parser.add_argument("--tiny", action="store_true", help="unit-test sizes (a smoke run, not a result)")
    parser.add_argument("--max-load", type=float, default=DEFAULT_MAX_LOAD)
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")


def start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Environment:
    """Check the shared options and the machine; the Environment that records the run."""
    warmup = getattr(args, "warmup", 1)
    if args.rounds < 1 or warmup < 1 or args.steps <= warmup:
        parser.error("give --rounds >= 1, --warmup >= 1 and --steps above it (the warm-up steps are not timed)")
    require_quiet(args.max_load, force=args.force)
    return Environment(forced=args.force)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def step_summary(values_us: list[float]) -> dict[str, float]:
    """Median and 10th-90th percentiles of step times in microseconds, as milliseconds, and the count."""
    return {
        "median_ms": statistics.median(values_us) / 1e3,
        "p10_ms": percentile(values_us, 0.1) / 1e3,
        "p90_ms": percentile(values_us, 0.9) / 1e3,
        "samples": len(values_us),
    }


def seconds_summary(values: list[float]) -> dict[str, float]:
    """Median and 10th-90th percentiles of wall times in seconds, and the count."""
    return {
        "median_s": statistics.median(values),
        "p10_s": percentile(values, 0.1),
        "p90_s": percentile(values, 0.9),
        "runs": len(values),
    }


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Print the load before and after (``record["environment"]``, from ``Environment.finish``), write the JSON."""
    environment = record["environment"]
    print(f"load average before {environment['load_average_before']}, after {environment['load_average_after']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {path}")
