"""Exposed collective time: how long a rank's collective stream runs while its compute stream does not.

A collective that runs under compute costs the step nothing (on a GPU; on CPU
ranks it shares the cores, which shows up as slower compute instead). What
the step pays is the time the collective stream is busy while no computation
runs: a computation waiting for its UNSHARD, or the step's tail waiting for
the last REDUCE_GRAD. The same function reads a simulated timeline and a
measured one, so the two compare directly.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["exposed_collective_us"]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_collective_us(spans: Iterable[tuple[str, float, float]]) -> float:
    """Of one rank's ``(stream, start, end)`` spans, the time in ``collective`` spans not covered by any
    ``compute`` span (the same unit as the spans)."""
    collective: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for stream, start, end in spans:
        if end < start:
            raise ValueError(f"a {stream} span ends ({end}) before it starts ({start})")
        if stream == "collective":
            collective.append((start, end))
        elif stream == "compute":
            compute.append((start, end))
    covered = _union(compute)
    exposed = 0.0
    for start, end in _union(collective):
        exposed += end - start
        for c_start, c_end in covered:
            overlap = min(end, c_end) - max(start, c_start)
            if overlap > 0:
                exposed -= overlap
    return exposed
