"""Side-by-side timing that cannot pick a lucky baseline: every candidate in every round, bootstrap intervals.

A candidate is a named launch (a torch schedule on torch's runtime, the same
order on octopipe's, a tuned plan) that returns the step times of one launch
(warm-up left out). ``run_rounds`` runs every candidate once per round, for
every round, rotating which goes first so no candidate always follows the same
neighbour. A candidate that fails is recorded with its error's first line and
not run again.

Intervals come from a two-level bootstrap: launches are resampled with
replacement, then steps within each drawn launch, so the spread between
launches (a process's memory layout, a neighbour on the core) counts, not only
the spread between steps of one launch. A "best of several" baseline is chosen
again in every draw (``best_ratio_interval``), so the winner's luck is part of
the interval rather than a bias in our favour.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from quiet import percentile

__all__ = [
    "Candidate",
    "Measured",
    "best_ratio_interval",
    "first_line",
    "ratio_interval",
    "run_rounds",
    "summary",
]

#: draws of every bootstrap
DRAWS = 4000


@dataclass
class Candidate:
    """One thing to time: ``run()`` launches it once and returns the step times (us) after its warm-up."""

    name: str
    run: Callable[[], list[float]]


@dataclass
class Measured:
    """A candidate's step times, one list per launch, or the error that stopped it."""

    name: str
    launches: list[list[float]] = field(default_factory=list)
    error: str = ""

    @property
    def samples(self) -> list[float]:
        return [t for launch in self.launches for t in launch]

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples)


def first_line(exc: BaseException) -> str:
    """An error's first meaningful line: in a child process's chained traceback, the root cause's (whose text
    may start on the next line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    heads = [i for i, line in enumerate(lines) if line.split(":")[0].endswith(("Error", "Exception"))]
    if not heads:
        return (lines[0] if lines else type(exc).__name__)[:300]
    index = heads[0]
    text = lines[index]
    if text.endswith(":") and index + 1 < len(lines):
        text = f"{text} {lines[index + 1]}"
    return text[:300]


def run_rounds(candidates: Sequence[Candidate], rounds: int, *, log: Callable[[str], None] = print) -> list[Measured]:
    """Every candidate once per round, ``rounds`` rounds, each round starting one further along the list."""
    measured = [Measured(c.name) for c in candidates]
    count = len(candidates)
    for round_index in range(rounds):
        for offset in range(count):
            index = (round_index + offset) % count
            candidate, record = candidates[index], measured[index]
            if record.error:
                continue
            start = time.monotonic()
            try:
                times = candidate.run()
            except Exception as exc:  # a schedule torch cannot run this way: recorded, never retried
                record.error = first_line(exc)
                log(f"  round {round_index + 1}: {candidate.name} failed: {record.error}")
                continue
            record.launches.append(times)
            log(
                f"  round {round_index + 1}: {candidate.name}: median {statistics.median(times) / 1e3:.0f} ms "
                f"({len(times)} steps, launch {time.monotonic() - start:.0f} s)"
            )
    return measured


def _draw(launches: list[list[float]], rng: random.Random) -> float:
    chosen = [launches[rng.randrange(len(launches))] for _ in launches]
    return statistics.median([launch[rng.randrange(len(launch))] for launch in chosen for _ in launch])


def ratio_interval(numerator: Measured, denominator: Measured, *, seed: int = 0) -> tuple[float, float]:
    """The 90% bootstrap interval of median(numerator) / median(denominator)."""
    rng = random.Random(seed)
    ratios = sorted(_draw(numerator.launches, rng) / _draw(denominator.launches, rng) for _ in range(DRAWS))
    return percentile(ratios, 0.05), percentile(ratios, 0.95)


def best_ratio_interval(baselines: Sequence[Measured], ours: Measured, *, seed: int = 0) -> tuple[float, float]:
    """The 90% bootstrap interval of min(median of each baseline) / median(ours): the best baseline is chosen
    again in every draw (a throughput ratio: above 1 means ours is faster than the best)."""
    rng = random.Random(seed)
    usable = [b for b in baselines if b.launches]
    ratios = sorted(min(_draw(b.launches, rng) for b in usable) / _draw(ours.launches, rng) for _ in range(DRAWS))
    return percentile(ratios, 0.05), percentile(ratios, 0.95)


def summary(record: Measured) -> dict[str, Any]:
    """Median and 10th-90th percentiles (ms) over every step of every launch, counts, per-launch medians."""
    if not record.launches:
        return {"error": record.error, "samples": 0, "launches": 0}
    values = record.samples
    return {
        "median_ms": statistics.median(values) / 1e3,
        "p10_ms": percentile(values, 0.1) / 1e3,
        "p90_ms": percentile(values, 0.9) / 1e3,
        "samples": len(values),
        "launches": len(record.launches),
        "launch_medians_ms": [round(statistics.median(launch) / 1e3, 2) for launch in record.launches],
        **({"error_after_some_launches": record.error} if record.error else {}),
    }
