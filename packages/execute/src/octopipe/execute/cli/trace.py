"""``octopipe trace``: a Perfetto trace (and PNG) of a plan, simulated, measured, or both side by side.

The measured timelines come from ``octopipe run PLAN --timeline FILE`` (a Profile
holding ``RankTimeline`` messages); the simulated one from the plan and a
Profile of layer costs (``octopipe profile``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from octopipe.execute.cli.jsonout import print_json
from octopipe.execute.cli.profile import load_profile
from octopipe.execute.cli.simulate import simulate_file
from octopipe.execute.runs import RunResult, StepTimeline
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import plot_timeline, to_chrome_trace
from octopipe.tune import ScheduleRegistry

__all__ = ["measured_result", "register", "run"]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe trace`` to the CLI's subcommands."""
    parser = sub.add_parser(
        "trace", help="write a Perfetto trace of a plan: simulated, measured (from `run --timeline`), or both"
    )
    parser.set_defaults(handler=run)
    parser.add_argument("plan", type=Path, help="plan file (.binpb/.pb, .json, .txt/.plan, .csv)")
    parser.add_argument("--profile", type=Path, help="layer costs: add the simulated timeline")
    parser.add_argument("--timeline", type=Path, help="measured timelines from `octopipe run --timeline FILE`")
    parser.add_argument("--step", type=int, help="the measured step to show (default: the last)")
    parser.add_argument("--out", type=Path, default=Path("out/trace.json"), help="the trace file (.json)")
    parser.add_argument("--png", type=Path, help="also draw the simulated timeline and memory to a PNG")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")


def measured_result(timelines: list[profile_pb2.RankTimeline]) -> RunResult:
    """The measured ``RankTimeline`` messages as a ``runtime.RunResult`` (times relative to each step's start)."""

    by_rank: dict[int, dict[int, StepTimeline]] = {}
    for timeline in timelines:
        by_rank.setdefault(timeline.rank, {})[timeline.step] = StepTimeline.from_proto(timeline)
    steps = sorted({s for per_rank in by_rank.values() for s in per_rank})
    if not steps or any(sorted(per_rank) != steps for per_rank in by_rank.values()):
        raise ValueError("the timeline file must hold the same steps for every rank (write it with `octopipe run`)")
    return RunResult(losses=[], timelines={r: [by_rank[r][s] for s in steps] for r in sorted(by_rank)})


def run(args: argparse.Namespace) -> int:

    if args.out.suffix != ".json":
        raise ValueError(f"--out {args.out}: a trace is a .json file")
    simulation = simulate_file(args.plan, args.profile) if args.profile or not args.timeline else None
    if args.timeline:
        from octopipe.execute.runtime import side_by_side_trace  # noqa: PLC0415

        timelines = list(load_profile(args.timeline).timelines)
        if not timelines:
            raise ValueError(f"{args.timeline} holds no timelines: write one with `octopipe run PLAN --timeline FILE`")
        result = measured_result(timelines)
        count = len(next(iter(result.timelines.values())))
        step = count - 1 if args.step is None else args.step
        if not 0 <= step < count:
            raise ValueError(f"--step {args.step}: the timeline holds steps 0 to {count - 1}")
        trace = side_by_side_trace(simulation, result, step=step)
    else:
        assert simulation is not None
        trace = to_chrome_trace(simulation)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    written = {"trace": str(args.out)}
    if args.png:
        if simulation is None:
            raise ValueError("--png draws the simulated timeline: give --profile too")
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot_timeline(simulation, args.png)
        written["png"] = str(args.png)
    tracks = [t for t, on in (("simulated", simulation is not None), ("measured", bool(args.timeline))) if on]
    if args.json:
        print_json({"files": written, "tracks": tracks})
    else:
        console = Console()
        console.print(f"written: {args.out} ({' and '.join(tracks)}; open in https://ui.perfetto.dev)", highlight=False)
        if args.png:
            console.print(f"written: {args.png}", highlight=False)
    return 0
