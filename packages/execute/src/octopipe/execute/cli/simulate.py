"""``octopipe simulate``: verify a plan and predict one step (time, bubble, memory per rank) from a Profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from octopipe.execute.cli.jsonout import estimate_json, print_json
from octopipe.execute.cli.profile import load_profile
from octopipe.ir import load_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    CostModel,
    Estimate,
    Simulation,
    StageCost,
    local_cost_model,
    plot_timeline,
    simulate,
    uniform_profile,
    verify_plan,
    write_chrome_trace,
)
from octopipe.tune import ScheduleRegistry

__all__ = ["register", "run", "simulate_file"]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe simulate`` to the CLI's subcommands."""
    parser = sub.add_parser("simulate", help="verify a plan and predict its step time and memory from a Profile")
    parser.set_defaults(handler=run)
    parser.add_argument("plan", type=Path, help="plan file (.binpb/.pb, .json, .txt/.plan, .csv)")
    parser.add_argument(
        "--profile", type=Path, help="a Profile from `octopipe profile` (default: every action of a layer costs 1 us)"
    )
    parser.add_argument("--memory-cap", type=int, help="bytes per rank: reject the plan if any rank needs more")
    parser.add_argument("--trace", type=Path, help="also write the simulated timeline as a Perfetto trace (.json)")
    parser.add_argument("--png", type=Path, help="also draw the simulated timeline and memory to a PNG")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON instead of a table")


def _costs(plan: plan_pb2.Plan, profile_path: Path | None) -> profile_pb2.Profile | CostModel:

    if profile_path is None:  # unit costs: every layer (or, in a plan that names none, every stage) 1 us per action
        if any(stage.layer_names for stage in plan.stages):
            return uniform_profile(plan)
        unit = StageCost(forward_us=1.0, backward_input_us=1.0, backward_weight_us=1.0)
        return CostModel.uniform(num_stages=len(plan.stages), stage=unit)
    profile = load_profile(profile_path)
    missing = sorted({n for s in plan.stages for n in s.layer_names} - {c.layer_name for c in profile.layers})
    if missing:
        raise ValueError(
            f"{profile_path} has no costs for layers {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: "
            "profile the model the plan names (`octopipe profile --workload ...`)"
        )
    return local_cost_model(plan, profile)


def simulate_file(plan_path: Path, profile_path: Path | None, memory_cap: int | None = None) -> Simulation:
    """Load, verify (memory caps included) and simulate a plan file; ValueError saying what to change."""
    plan = load_plan(plan_path)
    if memory_cap is not None:
        if memory_cap <= 0:
            raise ValueError(f"--memory-cap must be a positive number of bytes, got {memory_cap}")
        for rank in plan.ranks:
            rank.memory_cap_bytes = memory_cap
    costs = _costs(plan, profile_path)
    verify_plan(plan, costs)
    return simulate(plan, costs)


def _print_table(estimate: Estimate, plan_path: Path) -> None:

    console = Console()
    console.print(
        f"{estimate.plan_name or plan_path.name}: verified (no deadlock, every input before use, within memory caps)"
    )
    console.print(
        f"step {estimate.step_time_us / 1e3:.3f} ms, {estimate.samples_per_second:.2f} samples/s, "
        f"bubble {estimate.bubble_ratio:.1%}, communication hidden {estimate.communication_overlap_ratio:.1%}",
        highlight=False,
    )
    table = Table()
    for column in ("rank", "busy ms", "idle ms", "bubble", "peak memory MiB", "of it activations MiB", "cap MiB"):
        table.add_column(column, justify="right")
    for r in estimate.ranks:
        table.add_row(
            str(r.rank),
            f"{r.busy_us / 1e3:.3f}",
            f"{r.idle_us / 1e3:.3f}",
            f"{r.bubble_ratio:.1%}",
            f"{r.peak_memory_bytes / 2**20:.2f}",
            f"{r.peak_activation_bytes / 2**20:.2f}",
            "-" if r.memory_cap_bytes is None else f"{r.memory_cap_bytes / 2**20:.2f}",
        )
    console.print(table)


def run(args: argparse.Namespace) -> int:

    simulation = simulate_file(args.plan, args.profile, args.memory_cap)
    if args.trace:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(simulation, args.trace)
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot_timeline(simulation, args.png)
    if args.json:
        document = estimate_json(simulation.estimate)
        document["files"] = {k: str(v) for k, v in (("trace", args.trace), ("png", args.png)) if v}
        print_json(document)
    else:
        _print_table(simulation.estimate, args.plan)
        for path in (args.trace, args.png):
            if path:
                sys.stdout.write(f"written: {path}\n")
    return 0
