"""Measured timelines: into Profile protos, into Perfetto traces beside the simulator's, into step times.

Times in a RunResult are the machine's monotonic clock (comparable across local
ranks, which start each step behind a barrier). Here they become microseconds
from the step's earliest action start on any rank.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from octopipe.execute.runtime.launcher import RunResult
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Simulation, to_chrome_trace

__all__ = [
    "MEASURED_PID_OFFSET",
    "measured_step_times_us",
    "measured_trace_events",
    "median_step_time_us",
    "side_by_side_trace",
    "timelines_to_proto",
    "write_side_by_side_trace",
]

MEASURED_PID_OFFSET = 1000


def _step_origin(result: RunResult, step: int) -> int:
    return min(steps[step].start_ns for steps in result.timelines.values())


def measured_step_times_us(result: RunResult) -> list[float]:
    """Per step: from the first rank's start to the last rank's end, in microseconds."""
    count = min(len(steps) for steps in result.timelines.values())
    return [
        (max(steps[i].end_ns for steps in result.timelines.values()) - _step_origin(result, i)) / 1e3
        for i in range(count)
    ]


def timelines_to_proto(result: RunResult) -> list[profile_pb2.RankTimeline]:
    """Every rank's every step as ``RankTimeline`` messages (memory: bytes the program holds)."""
    timelines = []
    for rank in sorted(result.timelines):
        for step, data in enumerate(result.timelines[rank]):
            timeline = data.to_proto(_step_origin(result, step))  # times from the step's start on any rank
            timeline.step = step
            timelines.append(timeline)
    return timelines


def measured_trace_events(
    result: RunResult, *, step: int, pid_offset: int = MEASURED_PID_OFFSET
) -> list[dict[str, Any]]:
    """Chrome trace events of one measured step: a process per rank, a track per stream, a memory counter.
    An emulated run's ranks are named "emulated rank r" (``RunResult.emulated``)."""
    origin = _step_origin(result, step)
    label = "emulated" if result.emulated else "measured"
    events: list[dict[str, Any]] = []
    tids = {"compute": 0, "collective": 1, "send": 2, "recv": 3}
    for rank in sorted(result.timelines):
        pid = pid_offset + rank
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{label} rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        for stream, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": stream}})
        for record in result.timelines[rank][step].records:
            start = (record.start_ns - origin) / 1e3
            events.append(
                {
                    "name": record.action,
                    "cat": f"{label} {record.stream}",
                    "ph": "X",
                    "pid": pid,
                    "tid": tids[record.stream],
                    "ts": start,
                    "dur": (record.end_ns - record.start_ns) / 1e3,
                }
            )
            events.append(
                {"name": "memory", "ph": "C", "pid": pid, "ts": start, "args": {"held bytes": record.held_bytes}}
            )
    return events


def side_by_side_trace(simulation: Simulation | None, result: RunResult, *, step: int) -> dict[str, Any]:
    """One trace: the simulator's ranks ("simulated rank r") above the measured ones ("measured rank r", or
    "emulated rank r" for an emulated run)."""
    trace: dict[str, Any] = to_chrome_trace(simulation) if simulation is not None else {"traceEvents": []}
    for event in trace["traceEvents"]:
        if event.get("name") == "process_name" and event.get("ph") == "M":
            event["args"]["name"] = f"simulated {event['args']['name']}"
    trace["traceEvents"].extend(measured_trace_events(result, step=step))
    trace.setdefault("displayTimeUnit", "ms")
    return trace


def write_side_by_side_trace(path: Path, simulation: Simulation | None, result: RunResult, *, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(side_by_side_trace(simulation, result, step=step)))


def median_step_time_us(result: RunResult, *, skip_first: bool = True) -> float:
    """Median measured step time; the first step (warm-up) is left out when there are others."""
    times = measured_step_times_us(result)
    if skip_first and len(times) > 1:
        times = times[1:]
    return statistics.median(times)
