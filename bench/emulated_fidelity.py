"""Emulated execution against the simulator at 4-16 ranks: every registry schedule plus the tuned plan.

The real runtime runs each plan (``RunOptions(emulate=profile)``: the one interpreter, its channels, real
gloo messages of the profiled boundary sizes, every computation waiting for its profiled duration;
``octopipe.execute.runtime.emulate``), and the simulator predicts the same plan from the same profile
(``simulate.local_cost_model``). What differs is the runtime's own cost (dispatch, message handling, the
channel threads, ranks time-sharing this machine's cores) and the link: never kernels.

Profiles: the simulated workloads of shared/benchmarks.md (``bench/tune_workloads.py``: per-layer-type
costs measured on this machine's CPU at hidden 256, micro-batch 4 x 128), every duration multiplied by
``--time-scale`` (default 0.2), which puts a layer's F at 1.2-10 ms. At 0.05 (0.3-2.6 ms, the order of an
8B-class layer on one GPU at 4k tokens) 8 emulated ranks keep ~60% of this 2-core host busy with the
runtime's own threads and 512 KiB loopback messages (``perf``: Python 24%, gloo's TCP loop 16%, 22k context
switches/s), a message's hop to a waiting rank takes 1.0-1.5 ms at the median instead of 0.6, and the
emulated step is the host's queueing, not the plan's (interleaved-1F1B-4 at p=8: +48%). Every cell records
``host_cpu_busy``, the share of all cores busy while its timed steps ran (``quiet.HostCpu``), so a figure
taken with the host as the bottleneck shows it. Boundary messages keep the
measured 512 KiB. Links: this machine's gloo loopback as the probe measures it (``--latency-us`` /
``--bandwidth`` override), in the profile, so prediction and execution share the link. Emulated ranks
share the cores (they wait rather than compute; not pinned).

Grid: p in ``--ranks`` (4, 8, 16), m in ``--m-factors`` x p (2p, 4p); plans: every registry schedule
that exists at (p, m) with equal layer counts, and the tuner's plan (memory cap: 1F1B's peak). All plans of
one (p, m) run in one launch, one after the other, ``--steps`` steps each, the first ``--warmup`` left out;
``--rounds`` launches per cell, in turn. Written: ``results/emulated_fidelity.json`` with ``cells[]``
(``p``, ``m``, ``plan``, ``predicted_ms``, ``executed_ms``, ``error`` = executed / predicted - 1) and
``tuned_over_best_library[]`` (``p``, ``m``, ``predicted``, ``executed``: the tuned plan's throughput over
the best library schedule's, each by its own measure).

With ``--runtime-costs results/runtime_costs.json`` (``bench/runtime_costs.py``) every profile carries the
runtime's own costs (``octopipe.simulate.RuntimeCosts``), which the prediction and the tuner read; every cell
also reports the prediction without them (``predicted_without_runtime_ms``, ``error_without_runtime``).

    .venv/bin/python bench/emulated_fidelity.py [--workloads nemotronh-8b jamba-32] [--ranks 4 8 16]
        [--m-factors 2 4] [--time-scale 0.2] [--steps 4] [--warmup 2] [--rounds 1]
        [--runtime-costs bench/results/runtime_costs.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, HostCpu, add_arguments, start, write_record
from tune_workloads import workload_profile

from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local_many
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import RuntimeCosts, local_cost_model, local_link, simulate
from octopipe.tune import DEFAULT_SCHEDULES, TuneConfig, equal_partition, tune

OUT = Path(__file__).parent / "results" / "emulated_fidelity.json"


def scaled_profile(workload: str, scale: float, latency_us: float, bandwidth: float) -> profile_pb2.Profile:
    """The workload's profile with every duration times ``scale`` and this machine's link between all ranks."""
    profile = workload_profile(workload)
    for layer in profile.layers:
        for cost in (layer, *layer.recomputed):  # the recomputation variants' durations too
            cost.forward_duration_us *= scale
            cost.backward_input_duration_us *= scale
            cost.backward_weight_duration_us *= scale
    for link in profile.links:
        link.latency_us, link.bandwidth_bytes_per_second = latency_us, bandwidth
    profile.labels["emulated_time_scale"] = str(scale)
    return profile


def library_plans(profile: profile_pb2.Profile, p: int, m: int) -> tuple[list[plan_pb2.Plan], dict[str, str]]:
    """Every registry schedule at (p, m) with equal layer counts; the ones that do not exist, with why."""
    names = [layer.layer_name for layer in profile.layers]
    plans, skipped = [], {}
    for entry in DEFAULT_SCHEDULES:
        if not entry.tunable:
            continue
        stages = p * entry.placement.stages_per_rank
        if stages > len(names):
            skipped[entry.name] = f"{stages} stages for {len(names)} layers"
            continue
        try:
            plans.append(entry.generate(p, m, layer_names=equal_partition(names, stages)))
        except ValueError as exc:
            skipped[entry.name] = str(exc).splitlines()[0]
    return plans, skipped


def tuned_plan(profile: profile_pb2.Profile, p: int, m: int, budget_s: float, cap: int | None = None) -> plan_pb2.Plan:
    """The tuner's plan under ``cap`` per rank (None: 1F1B's peak), recomputation searched where profiled."""
    config = TuneConfig(
        num_ranks=p, num_microbatches=m, time_budget_s=budget_s, default_link=local_link(profile), memory_cap_bytes=cap
    )
    plan = tune(profile, config).plan
    plan.name = plan.name if plan.name.startswith("tuned") else f"tuned-{plan.name}"
    plan.labels["schedule"] = "tuned"
    return plan


def cell(
    workload: str, profile: profile_pb2.Profile, p: int, m: int, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    plans, skipped = library_plans(profile, p, m)
    started = time.monotonic()
    plans.append(tuned_plan(profile, p, m, args.tune_budget))
    tune_s = time.monotonic() - started
    estimates = {plan.name: simulate(plan, local_cost_model(plan, profile)).estimate for plan in plans}
    predicted = {name: estimate.step_time_us for name, estimate in estimates.items()}
    peak = {name: max(r.peak_memory_bytes for r in estimate.ranks) for name, estimate in estimates.items()}
    bare = profile_pb2.Profile()
    bare.CopyFrom(profile)
    bare.ClearField("runtime")  # the same prediction without the runtime's own costs
    predicted_bare = {plan.name: simulate(plan, local_cost_model(plan, bare)).estimate.step_time_us for plan in plans}
    executed: dict[str, list[float]] = {plan.name: [] for plan in plans}
    host_busy: dict[str, list[float]] = {plan.name: [] for plan in plans}
    options = RunOptions(steps=args.steps, timeout_s=args.timeout, emulate=profile)
    for round_ in range(args.rounds):
        order = plans[round_ % len(plans) :] + plans[: round_ % len(plans)]  # rotate who goes first
        with HostCpu() as cpu:
            results = run_local_many(order, options)
        for plan, result in zip(order, results, strict=True):
            assert result.emulated
            executed[plan.name].extend(measured_step_times_us(result)[args.warmup :])
            # the host's busy share while this plan's timed steps ran (every rank, every core)
            window = [steps[args.warmup :] for steps in result.timelines.values()]
            busy = cpu.busy(min(s[0].start_ns for s in window), max(s[-1].end_ns for s in window))
            if busy is not None:
                host_busy[plan.name].append(busy)
    rows: list[dict[str, Any]] = []
    for plan in plans:
        times = executed[plan.name]
        median = statistics.median(times)
        rows.append(
            {
                "workload": workload,
                "p": p,
                "m": m,
                "plan": plan.name,
                "schedule": plan.labels.get("schedule", ""),
                "predicted_ms": predicted[plan.name] / 1e3,
                "executed_ms": median / 1e3,
                "executed_p10_ms": sorted(times)[len(times) // 10] / 1e3,
                "executed_p90_ms": sorted(times)[(9 * len(times)) // 10] / 1e3,
                "steps": len(times),
                "error": median / predicted[plan.name] - 1,
                "predicted_without_runtime_ms": predicted_bare[plan.name] / 1e3,
                "error_without_runtime": median / predicted_bare[plan.name] - 1,
                "predicted_peak_memory_bytes": peak[plan.name],
                "host_cpu_busy": statistics.median(host_busy[plan.name]) if host_busy[plan.name] else None,
            }
        )
        print(
            f"  {workload} p={p:2d} m={m:3d} {plan.name:28s} predicted {predicted[plan.name] / 1e3:8.1f} ms  "
            f"emulated {median / 1e3:8.1f} ms  error {rows[-1]['error']:+.1%} "
            f"(without the runtime's costs {rows[-1]['error_without_runtime']:+.1%}); host cores busy "
            f"{rows[-1]['host_cpu_busy'] or 0:.0%}",
            flush=True,
        )
    library = [r for r in rows if r["schedule"] != "tuned"]
    tuned = next(r for r in rows if r["schedule"] == "tuned")
    best_predicted = min(library, key=lambda r: r["predicted_ms"])
    best_executed = min(library, key=lambda r: r["executed_ms"])
    # the tuner's cap is 1F1B's peak: the library schedules that fit under it are its real competition
    cap = next(r for r in library if r["schedule"] == "1f1b")["predicted_peak_memory_bytes"]
    fitting = [r for r in library if r["predicted_peak_memory_bytes"] <= cap]
    fit_predicted = min(fitting, key=lambda r: r["predicted_ms"])
    fit_executed = min(fitting, key=lambda r: r["executed_ms"])
    comparison = {
        "workload": workload,
        "p": p,
        "m": m,
        "tuned": tuned["plan"],
        "best_library_predicted": best_predicted["plan"],
        "best_library_executed": best_executed["plan"],
        "predicted": best_predicted["predicted_ms"] / tuned["predicted_ms"],
        "executed": best_executed["executed_ms"] / tuned["executed_ms"],
        "memory_cap_bytes": cap,
        "best_library_within_cap_predicted": fit_predicted["plan"],
        "best_library_within_cap_executed": fit_executed["plan"],
        "predicted_within_cap": fit_predicted["predicted_ms"] / tuned["predicted_ms"],
        "executed_within_cap": fit_executed["executed_ms"] / tuned["executed_ms"],
        "tune_s": tune_s,
        "skipped": skipped,
    }
    return rows, comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["nemotronh-8b", "jamba-32"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--m-factors", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--tune-budget", type=float, default=20.0, help="the tuner's seconds per cell")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--latency-us", type=float, help="the link's latency (default: probed)")
    parser.add_argument("--bandwidth", type=float, help="the link's bytes/s (default: probed)")
    parser.add_argument(
        "--runtime-costs",
        type=Path,
        help="results/runtime_costs.json (bench/runtime_costs.py): the runtime's terms, put in every profile",
    )
    parser.add_argument(
        "--thread-share",
        type=float,
        default=0.0,
        help="the runtime terms' thread_share here (default 0: an emulated computation waits, it takes no core)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    add_arguments(parser, rounds=1, steps=4, warmup=True)
    args = parser.parse_args()
    env: Environment = start(parser, args)
    if args.latency_us is None or args.bandwidth is None:
        probed, _ = measure_link()
        args.latency_us = args.latency_us if args.latency_us is not None else probed.latency_us
        args.bandwidth = args.bandwidth if args.bandwidth is not None else probed.bandwidth_bytes_per_second
    runtime = None
    if args.runtime_costs is not None:
        terms = json.loads(args.runtime_costs.read_text())["terms"]
        # an emulated computation waits rather than computes: the channel threads take nothing from it
        terms["thread_share"] = args.thread_share
        runtime = RuntimeCosts.from_terms(terms)
    cells: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    for workload in args.workloads:
        profile = scaled_profile(workload, args.time_scale, args.latency_us, args.bandwidth)
        if runtime is not None:
            profile.runtime.CopyFrom(runtime.to_proto(source=str(args.runtime_costs)))
        for p in args.ranks:
            for factor in args.m_factors:
                rows, comparison = cell(workload, profile, p, factor * p, args)
                cells.extend(rows)
                comparisons.append(comparison)
    errors = [abs(c["error"]) for c in cells]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "source": "bench/emulated_fidelity.py",
        "compute": "EMULATED: every computation waited for its profiled duration; no kernel ran",
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "time_scale": args.time_scale,
        "link": {"latency_us": args.latency_us, "bandwidth_bytes_per_second": args.bandwidth},
        "steps_per_plan": args.steps,
        "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "environment": env.finish(),
        "cells": cells,
        "tuned_over_best_library": comparisons,
        "max_abs_error": max(errors),
        "median_abs_error": statistics.median(errors),
        "cells_within_3_percent": sum(e <= 0.03 for e in errors),
        "runtime_costs": None if runtime is None else {"source": str(args.runtime_costs), "terms": runtime.terms()},
        "host_cpu_busy_max": max((c["host_cpu_busy"] or 0.0) for c in cells),
        "median_abs_error_without_runtime": statistics.median(abs(c["error_without_runtime"]) for c in cells),
        "max_abs_error_without_runtime": max(abs(c["error_without_runtime"]) for c in cells),
    }
    write_record(args.out, record)
    print(
        f"{len(cells)} cells: |error| median {statistics.median(errors):.1%}, max {max(errors):.1%}, "
        f"{record['cells_within_3_percent']} within 3%; written {args.out}"
    )
    for c in comparisons:
        print(
            f"  {c['workload']} p={c['p']} m={c['m']}: tuned / best library predicted {c['predicted']:.3f}x, "
            f"emulated {c['executed']:.3f}x; over the best within 1F1B's memory predicted "
            f"{c['predicted_within_cap']:.3f}x, emulated {c['executed_within_cap']:.3f}x"
        )


if __name__ == "__main__":
    main()
