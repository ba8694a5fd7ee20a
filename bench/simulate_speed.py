"""Simulation speed: how long ``octopipe.simulate.simulate`` takes for one plan, on one core.

The tuner calls the simulator thousands of times, so this is what it pays per
candidate: from a Plan and a Profile (both protos) to the Estimate, including
the static verification, the memory sweep, the communication overlap and the
critical path. Goals (issue 5): p=8, m=32 in <= 5 ms; p=64, m=512 (1F1B, about
200k actions with its SEND/RECV) in <= 1 s.

Workload: simulation speed does not depend on the cost values, only on the
plan's size and on which code paths run, so the profile is ``uniform_profile``
with every path switched on (F/I/W times, saved activations freed half by I,
parameters, 64 KiB boundary tensors and 1 us / 10 GB/s links, so p2p buffers
enter the memory sweep). Plans come from octopipe.tune's generators and are
built before timing. Cases run interleaved (A B C A B C ...), the process
pinned to one core, with the garbage collector on as it would be in the tuner;
the table shows medians and spreads (10th-90th percentile) of wall-clock time
and the median CPU time of the process.

    .venv/bin/python bench/simulate_speed.py [--rounds 9] [--small-repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import SimulationConfig, __version__, simulate, uniform_profile, verify_plan
from octopipe.tune import interleaved_1f1b, one_f_one_b, zb_h1

RESULTS = Path(__file__).resolve().parent / "results" / "simulate_speed.json"


@dataclass
class Case:
    name: str
    build: Callable[[], plan_pb2.Plan]
    goal_ms: float | None
    repeats: int  # simulations per round (small plans run several to beat timer noise)


def layer_names(num_stages: int) -> list[list[str]]:
    return [[f"layers.{s}"] for s in range(num_stages)]


def profile_for(plan: plan_pb2.Plan) -> profile_pb2.Profile:
    return uniform_profile(
        plan,
        forward_us=100.0,
        backward_input_us=110.0,
        backward_weight_us=90.0,
        activation_bytes=8 << 20,
        freed_by_backward_input_bytes=4 << 20,
        parameter_bytes=16 << 20,
        gradient_bytes=16 << 20,
        optimizer_state_bytes=32 << 20,
        output_bytes=64 << 10,
        latency_us=1.0,
        bandwidth_bytes_per_second=10e9,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def pin_to_one_core() -> int | None:
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case (after one warm-up round)")
    parser.add_argument("--small-repeats", type=int, default=20, help="simulations per round for the small plans")
    args = parser.parse_args()
    core = pin_to_one_core()
    cases = [
        Case("1F1B p=8 m=32", lambda: one_f_one_b(8, 32, layer_names=layer_names(8)), 5.0, args.small_repeats),
        Case(
            "interleaved p=8 v=2 m=32",
            lambda: interleaved_1f1b(8, 2, 32, layer_names=layer_names(16)),
            None,
            args.small_repeats,
        ),
        Case("ZB-H1 p=8 m=32", lambda: zb_h1(8, 32, layer_names=layer_names(8)), None, args.small_repeats),
        Case("1F1B p=64 m=512", lambda: one_f_one_b(64, 512, layer_names=layer_names(64)), 1000.0, 1),
        Case("ZB-H1 p=64 m=512", lambda: zb_h1(64, 512, layer_names=layer_names(64)), None, 1),
    ]
    inputs = []
    for case in cases:
        plan = case.build()
        profile = profile_for(plan)
        verify_plan(plan)  # every plan is valid; timing below includes verification again
        inputs.append((plan, profile))
    variants: dict[str, SimulationConfig] = {
        "simulate": SimulationConfig(),
        "no critical path": SimulationConfig(critical_path=False),
    }
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds + 1):
        for case, (plan, profile) in zip(cases, inputs, strict=True):
            for variant, config in variants.items():
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(case.repeats):
                    simulate(plan, profile, config=config)
                took_wall = (time.perf_counter() - start_wall) / case.repeats * 1e3
                took_cpu = (time.process_time() - start_cpu) / case.repeats * 1e3
                if round_index:  # round 0 warms up
                    wall.setdefault((case.name, variant), []).append(took_wall)
                    cpu.setdefault((case.name, variant), []).append(took_cpu)
    rows: list[dict[str, Any]] = []
    for case, (plan, _) in zip(cases, inputs, strict=True):
        actions = sum(len(program.actions) for program in plan.ranks)
        compute = sum(
            1 for program in plan.ranks for a in program.actions if a.kind <= plan_pb2.ACTION_KIND_OVERLAP_F_B
        )
        for variant in variants:
            times = wall[(case.name, variant)]
            median = statistics.median(times)
            rows.append(
                {
                    "case": case.name,
                    "variant": variant,
                    "ranks": len(plan.ranks),
                    "microbatches": plan.num_microbatches,
                    "actions": actions,
                    "compute_actions": compute,
                    "median_ms": median,
                    "p10_ms": percentile(times, 0.1),
                    "p90_ms": percentile(times, 0.9),
                    "min_ms": min(times),
                    "cpu_median_ms": statistics.median(cpu[(case.name, variant)]),
                    "us_per_action": median * 1e3 / actions,
                    "goal_ms": case.goal_ms if variant == "simulate" else None,
                    "meets_goal": None if case.goal_ms is None or variant != "simulate" else median <= case.goal_ms,
                    "samples": len(times),
                }
            )
    header = f"{'case':<26}{'variant':<18}{'actions':>8}{'median ms':>11}{'p10-p90 ms':>18}{'cpu ms':>9}{'us/action':>10}  goal"
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['p10_ms']:.2f}-{row['p90_ms']:.2f}"
        goal = "" if row["goal_ms"] is None else f"<= {row['goal_ms']:g} ms: {'met' if row['meets_goal'] else 'MISSED'}"
        print(
            f"{row['case']:<26}{row['variant']:<18}{row['actions']:>8}{row['median_ms']:>11.2f}{spread:>18}"
            f"{row['cpu_median_ms']:>9.2f}{row['us_per_action']:>10.2f}  {goal}"
        )
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "simulate_speed",
                "workload": "octopipe.tune generators; uniform_profile with all cost paths on (see the script's doc)",
                "simulator_version": __version__,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
                "pinned_core": core,
                "load_average_after": load,
                "rounds": args.rounds,
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten: {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")


if __name__ == "__main__":
    main()
