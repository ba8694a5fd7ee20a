"""``octopipe trace``: a Perfetto trace (and PNG) of a plan, simulated, measured, or both side by side.

The measured timelines come from ``octopipe run PLAN --timeline FILE`` (a Profile
holding ``RankTimeline`` messages) or from a coordinator's run (``--run RUN``: the
timelines its nodes reported, which the coordinator stores); the simulated one
from the plan and a Profile of layer costs (``octopipe profile``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from octopipe.execute.cli.connect import client_options, run_id_arg, with_client
from octopipe.execute.cli.errors import UsageError
from octopipe.execute.cli.jsonout import print_json
from octopipe.execute.cli.profile import load_profile
from octopipe.execute.cli.simulate import simulate_file
from octopipe.execute.runs import RunResult, StepTimeline
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import plot_timeline, to_chrome_trace
from octopipe.tune import ScheduleRegistry

__all__ = ["measured_result", "register", "run", "run_timelines"]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe trace`` to the CLI's subcommands."""
    parser = sub.add_parser(
        "trace", help="write a Perfetto trace of a plan: simulated, measured (from `run --timeline`), or both"
    )
    parser.set_defaults(handler=run)
    parser.add_argument(
        "plan", type=Path, nargs="?", help="plan file (.binpb/.pb, .json, .txt/.plan, .csv); optional with --run"
    )
    parser.add_argument("--profile", type=Path, help="layer costs: add the plan's simulated timeline")
    parser.add_argument("--timeline", type=Path, help="measured timelines from `octopipe run --timeline FILE`")
    parser.add_argument(
        "--run",
        metavar="RUN",
        type=run_id_arg,
        help="measured timelines of a coordinator's run (with --coordinator and --certs)",
    )
    client_options(parser, json_output=False, required=False)
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


def run_timelines(metrics: list[Any], rank_nodes: list[str]) -> tuple[RunResult, list[int]]:
    """A coordinator's stored ``StepMetrics`` of a run as a ``RunResult`` of the steps every rank reported, and
    those steps' numbers. A step run twice (after a resume) shows its last run. Ranks on one machine keep their
    shared clock; ranks on several machines share none, so each rank's step is drawn from its own start."""
    one_clock = len(set(rank_nodes)) <= 1
    latest: dict[tuple[int, int], Any] = {}
    for item in metrics:
        latest[(int(item.rank), int(item.step))] = item
    ranks = sorted({rank for rank, _ in latest})
    steps = sorted({step for _, step in latest if all((rank, step) in latest for rank in ranks)})
    timelines = {
        rank: [
            StepTimeline.from_proto(
                latest[(rank, step)].timeline,
                start_ns=int(latest[(rank, step)].step_start_ns) if one_clock else 0,
                duration_us=latest[(rank, step)].step_duration_us,
            )
            for step in steps
        ]
        for rank in ranks
    }
    return RunResult(losses=[], timelines=timelines), steps


def _from_file(path: Path) -> tuple[RunResult, list[int], str]:
    profile = load_profile(path)
    timelines = list(profile.timelines)
    if not timelines:
        raise ValueError(f"{path} holds no timelines: write one with `octopipe run PLAN --timeline FILE`")
    result = measured_result(timelines)
    result.emulated = profile.labels.get("compute") == "emulated"  # `octopipe run --emulate` wrote it
    label = "emulated (compute emulated, not measured)" if result.emulated else "measured"
    return result, list(range(len(next(iter(result.timelines.values()))))), label


def _from_run(client: Any, run_id: str) -> tuple[RunResult, list[int], str]:
    stored = client.run(run_id)
    result, steps = run_timelines(client.metrics(run_id, follow=False), list(stored.rank_nodes))
    if not steps:
        raise ValueError(f"run {run_id} has no step that every rank reported yet: see `octopipe runs {run_id}`")
    return result, steps, f"measured run {run_id}"


def run(args: argparse.Namespace) -> int:

    if args.out.suffix != ".json":
        raise ValueError(f"--out {args.out}: a trace is a .json file")
    if args.run and args.timeline:
        raise UsageError("--run and --timeline both name measured timelines: give one")
    if args.run and not (args.coordinator and args.certs):
        raise UsageError("--run reads the run from a coordinator: give --coordinator HOST:PORT and --certs DIR")
    if args.plan is None and (args.profile or not args.run):
        raise UsageError("give a plan file (to simulate it) or --run RUN (a coordinator's measured run)")
    if args.run:
        return with_client(args, lambda client: _write(args, _from_run(client, args.run)))
    return _write(args, _from_file(args.timeline) if args.timeline else None)


def _write(args: argparse.Namespace, measured: tuple[RunResult, list[int], str] | None) -> int:
    """Write the trace of ``measured`` (a result, its step numbers, a label), beside the plan's simulation when
    there is a profile (or alone when nothing was measured)."""
    simulation = simulate_file(args.plan, args.profile) if args.profile or measured is None else None
    shown: list[str] = ["simulated"] if simulation is not None else []
    step = None
    if measured is not None:
        from octopipe.execute.runtime.measure import side_by_side_trace  # noqa: PLC0415

        result, steps, label = measured
        step = steps[-1] if args.step is None else args.step
        if step not in steps:
            raise ValueError(f"--step {args.step}: the measured steps are {steps[0]} to {steps[-1]}")
        trace = side_by_side_trace(simulation, result, step=steps.index(step))
        shown.append(f"{label}, step {step}")
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
    tracks = [t for t, on in (("simulated", simulation is not None), ("measured", measured is not None)) if on]
    if args.json:
        print_json({"files": written, "tracks": tracks, "step": step})
    else:
        console = Console()
        console.print(f"written: {args.out} ({' and '.join(shown)}; open in https://ui.perfetto.dev)", highlight=False)
        if args.png:
            console.print(f"written: {args.png}", highlight=False)
    return 0
