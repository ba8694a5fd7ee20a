"""Timelines for people: a Perfetto / Chrome trace (JSON) and a PNG (matplotlib, optional).

The trace has one process per rank and one track (thread) per stream:
``compute``, ``collective``, and ``send -> r`` / ``recv <- r`` per peer (each
p2p channel is its own FIFO stream), plus a ``memory`` counter track per rank.
Open it at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from octopipe.ir.program import OVERLAP, B, F, I, W
from octopipe.simulate.simulator import Simulation

__all__ = ["plot_timeline", "to_chrome_trace", "write_chrome_trace"]

_COMPUTE_TID: Final = 0
_COLLECTIVE_TID: Final = 1
# Perfetto's reserved color names, by action kind.
_TRACE_COLORS: Final[dict[int, str]] = {
    F: "thread_state_running",
    I: "thread_state_runnable",
    B: "good",
    W: "rail_idle",
    OVERLAP: "terrible",
}
_PNG_COLORS: Final[dict[int, str]] = {F: "#4c72b0", I: "#55a868", B: "#2d7a3f", W: "#8172b3", OVERLAP: "#dd8452"}


def to_chrome_trace(simulation: Simulation) -> dict[str, Any]:
    """The Chrome trace-event JSON object of a simulation (times in microseconds)."""
    events: list[dict[str, Any]] = []
    for rank in range(simulation.num_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        tids = {"compute": _COMPUTE_TID, "collective": _COLLECTIVE_TID}
        for record in simulation.timeline(rank):
            if record.stream in ("send", "recv"):
                track = f"send -> {record.peer}" if record.stream == "send" else f"recv <- {record.peer}"
            else:
                track = record.stream
            if track not in tids:
                tids[track] = len(tids)
            event: dict[str, Any] = {
                "name": record.action,
                "cat": record.stream,
                "ph": "X",
                "pid": rank,
                "tid": tids[track],
                "ts": record.start_us,
                "dur": record.end_us - record.start_us,
                "args": {"step": record.step},
            }
            color = _TRACE_COLORS.get(simulation.program.codes[rank][record.step])
            if color is not None:
                event["cname"] = color
            events.append(event)
        for track, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )
        for time, total in simulation.memory_curve(rank):
            events.append({"name": "memory", "ph": "C", "pid": rank, "ts": time, "args": {"bytes": total}})
    estimate = simulation.estimate
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "plan": estimate.plan_name,
            "step_time_us": estimate.step_time_us,
            "bubble_ratio": estimate.bubble_ratio,
            "bubble_ratio_convention": "idle compute time / step time, averaged over ranks",
        },
    }


def write_chrome_trace(simulation: Simulation, path: Path) -> None:
    """Write the trace JSON to ``path`` (load it in Perfetto or chrome://tracing)."""
    path.write_text(json.dumps(to_chrome_trace(simulation), separators=(",", ":")) + "\n")


def plot_timeline(simulation: Simulation, path: Path, *, title: str | None = None, dpi: int = 120) -> None:
    """Draw each rank's compute timeline (and communication under it) and memory to a PNG.

    Needs matplotlib: ``pip install 'octopipe-simulate[png]'``.
    """
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 (optional dependency, loaded on use)
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_timeline needs matplotlib: pip install 'octopipe-simulate[png]' (or write a trace instead "
            "with write_chrome_trace)"
        ) from None
    ranks = simulation.num_ranks
    step_time = simulation.estimate.step_time_us or 1.0
    figure = Figure(figsize=(12, 1.0 + 0.55 * ranks + 2.2), layout="constrained")
    timeline, memory = figure.subplots(2, 1, height_ratios=[max(ranks, 1), 3], sharex=True)
    for rank in range(ranks):
        codes = simulation.program.codes[rank]
        bars: dict[str, list[tuple[float, float]]] = {}
        for record in simulation.timeline(rank):
            width = record.end_us - record.start_us
            kind = codes[record.step]
            if record.stream == "compute":
                bars.setdefault(_PNG_COLORS[kind], []).append((record.start_us, width))
                if width > step_time / 60:
                    timeline.text(
                        record.start_us + width / 2, rank, record.action, ha="center", va="center", fontsize=5
                    )
            elif width > 0:
                bars.setdefault("comm", []).append((record.start_us, width))
        for color, spans in bars.items():
            if color == "comm":
                timeline.broken_barh(spans, (rank + 0.3, 0.15), facecolors="#c44e52", alpha=0.6)
            else:
                timeline.broken_barh(spans, (rank - 0.35, 0.6), facecolors=color, edgecolor="white", linewidth=0.3)
        curve = simulation.memory_curve(rank)
        times = [t for t, _ in curve] + [simulation.estimate.step_time_us]
        values = [v / 2**20 for _, v in curve]
        memory.stairs(values, times, label=f"rank {rank}", baseline=None)
    timeline.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    timeline.set_ylim(ranks - 0.5, -0.5)
    timeline.legend(
        handles=[
            Patch(color=_PNG_COLORS[F], label="F"),
            Patch(color=_PNG_COLORS[I], label="I"),
            Patch(color=_PNG_COLORS[W], label="W"),
            Patch(color=_PNG_COLORS[B], label="B"),
            Patch(color=_PNG_COLORS[OVERLAP], label="F+B overlap"),
            Patch(color="#c44e52", alpha=0.6, label="p2p / collective"),
        ],
        loc="upper right",
        fontsize=6,
        ncols=6,
    )
    estimate = simulation.estimate
    timeline.set_title(
        title
        or f"{estimate.plan_name or 'plan'}: step {estimate.step_time_us:g} us, bubble ratio {estimate.bubble_ratio:.3f}"
    )
    memory.set_ylabel("memory (MiB)")
    memory.set_xlabel("time (us)")
    if ranks <= 16:
        memory.legend(fontsize=6, ncols=8)
    figure.savefig(path, dpi=dpi)
