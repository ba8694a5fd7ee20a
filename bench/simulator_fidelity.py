"""Simulator fidelity, the source of truth: predicted vs measured step time and peak memory, per plan.

For each workload (shared/benchmarks.md standard sizes, 2 ranks, m = 8) and
each plan -- every tunable registry schedule (GPipe, 1F1B, ZB-H1, ZB-H2,
interleaved 1F1B with 2 and 4 chunks, ZB-V, V-Half, V-Min, DualPipeV) with
equal layer counts, and the tuner's plan -- it

1. profiles the layers in lock-step (``runtime.lockstep.profile_in_lockstep``:
   one profiler per rank, each pinned to its rank's core, each timed sample
   started in all of them together, as the ranks compute in a pipeline) and,
   for comparison, alone (``pipeline.profile_reference``: one process, the
   other core idle), both again after the measured rounds: the predictions
   use the per-layer mean of the profiles before and after, which bracket the
   rounds in time (the host's speed drifts: the JSON records how far,
   ``profile_drift``), and the profile before alone is kept too
   (``before_ms``: what a user who profiles, then runs, is told); measures
   the gloo link (ranks pinned to two distinct cores, many round trips,
   medians);
2. predicts each plan's step with the simulator (``pipeline.compare``'s costs:
   the profile, the link); the plans: the library schedules with equal
   layer counts, the tuner's plan from the profile and from the calibration;
3. runs every plan in ONE launch of 2 ranks pinned to 2 distinct cores, the
   plans interleaved (A B C ... A B C ...) for ``--rounds`` rounds of
   ``--steps`` steps each (the first step of each run is warm-up), so drift in
   the machine touches every plan alike;
4. measures peak memory per rank with the allocator (``runtime.memory``: one
   extra pipeline step per plan under the profiler's memory events, in a
   separate launch so it never slows a timed step);
5. calibrates the profile in situ before the measured rounds
   (``pipeline.calibrate_in_situ``: layer times from a short separate run of
   1F1B and ZB-H1, per-action medians, and the link latency that reproduces
   their steps), tunes again on it ("tuned-calibrated"), and predicts every
   plan with it too (all out of sample: the measured rounds are other runs);
6. prints per cell: predicted (from the lock-step profile; the profile taken
   alone in the JSON as ``alone_ms``), measured median [p10, p90], replayed (the
   simulator fed the measured per-action durations: what is left is runtime
   overhead), step-time error, memory predicted / allocator-measured and its
   error; per workload Kendall tau over all plan pairs and over the pairs whose
   predictions differ by more than the measured noise; overall MAPE.

It refuses to start on a busy machine (1-minute load above ``--max-load``)
unless ``--force``, and fails if the ranks did not run on two distinct cores.
The JSON records the load before and after and each run's rank cores.

    .venv/bin/python bench/simulator_fidelity.py [--workloads llama-8 jamba-8 nemotronh-16 moe-ep-4]
        [--rounds 5] [--steps 2] [--tiny] [--force] [--runtime-costs bench/results/runtime_costs.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, add_arguments, start, write_record

from octopipe.execute.runtime import RunOptions, run_local_many, workload_reference
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.lockstep import merge_lockstep, profile_in_lockstep
from octopipe.execute.runtime.pipeline import calibrate_in_situ, compare, layer_names, profile_reference, tune_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import RuntimeCosts
from octopipe.tune import DEFAULT_SCHEDULES, TuneConfig, equal_partition

M, P = 8, 2
WORKLOADS = ["llama-8", "jamba-8", "nemotronh-16", "moe-ep-4"]


def library(reference: plan_pb2.ModelReference) -> list[plan_pb2.Plan]:
    """Every tunable registry schedule at (P, M) with equal layer counts (those with more stages than the model
    has layers are left out)."""
    names = layer_names(reference)
    plans = []
    for entry in DEFAULT_SCHEDULES:
        stages = P * entry.placement.stages_per_rank
        if entry.tunable and stages <= len(names):
            plans.append(entry.generate(P, M, layer_names=equal_partition(names, stages)))
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


def tuned_plan(profile: profile_pb2.Profile, label: str) -> plan_pb2.Plan:
    tuned = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=60.0)).plan
    tuned.labels["schedule"] = f"{label} {tuned.labels['schedule'].split('(')[0]}/{tuned.labels.get('placement', '')}"
    return tuned


def kendall_tau(a: list[float], b: list[float], pairs: list[tuple[int, int]] | None = None) -> float | None:
    """Rank agreement of ``a`` and ``b`` over ``pairs`` (default all): +1 same order, -1 reversed."""
    pairs = list(itertools.combinations(range(len(a)), 2)) if pairs is None else pairs
    if not pairs:
        return None
    score = sum(
        1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0 for i, j in pairs
    )
    return score / len(pairs)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def take_profiles(
    reference: plan_pb2.ModelReference, args: argparse.Namespace, link: Any
) -> tuple[profile_pb2.Profile, profile_pb2.Profile]:
    """The workload profiled in lock-step (the predictions' profile) and alone (for comparison), with the runtime's
    terms where given."""
    lockstep = profile_in_lockstep(reference, num_microbatches=M, num_ranks=P, link=link)
    alone = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link)
    if args.runtime_costs is not None:  # the runtime's own terms (bench/runtime_costs.py), as measured
        terms = json.loads(args.runtime_costs.read_text())["terms"]
        for costs in (lockstep, alone):
            costs.runtime.CopyFrom(RuntimeCosts.from_terms(terms).to_proto(source=str(args.runtime_costs)))
    return lockstep, alone


def layer_total_us(profile: profile_pb2.Profile) -> float:
    """F + I + W over every layer: one number to follow a profile's speed by."""
    return sum(
        c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us for c in profile.layers
    )


def drift(before: profile_pb2.Profile, after: profile_pb2.Profile) -> dict[str, float]:
    """How far the same layers' times moved between two profiles taken before and after the measured rounds."""
    changes = [
        getattr(b, field) / getattr(a, field) - 1.0
        for a, b in zip(before.layers, after.layers, strict=True)
        for field in ("forward_duration_us", "backward_input_duration_us", "backward_weight_duration_us")
        if getattr(a, field) > 0
    ]
    return {
        "total": layer_total_us(after) / layer_total_us(before) - 1.0,
        "median_abs_per_layer_and_kind": statistics.median(abs(c) for c in changes),
    }


def bench_workload(name: str, args: argparse.Namespace, link: Any, env: Environment) -> dict[str, Any]:
    reference = workload_reference(name, tiny=True, sequence=16) if args.tiny else workload_reference(name)
    # profiled in lock-step (each rank's core computing together, as in the pipeline), and again after the
    # measured rounds: the predictions use the per-layer mean of the two, which brackets the rounds in time
    first, first_alone = take_profiles(reference, args, link)
    timeout = 120.0 if args.tiny else 900.0
    plans = library(reference)
    # in-situ calibration: a short run of the two plain 2-stage plans (1F1B: fused backward; ZB-H1: split)
    by_schedule = {plan.labels["schedule"]: plan for plan in plans}
    sources = [by_schedule["1f1b"], by_schedule["zb-h1"]] * 2
    calibration_runs = run_local_many(sources, RunOptions(steps=args.steps, timeout_s=timeout))
    env.record(calibration_runs[0].cores)
    in_situ = calibrate_in_situ(first, list(zip(sources, calibration_runs, strict=True)))
    calibrated = in_situ.profile
    plans += [tuned_plan(first, "tuned"), tuned_plan(calibrated, "tuned-calibrated")]
    memory_runs = run_local_many(plans, RunOptions(steps=1, timeout_s=timeout, measure_memory=True))
    env.record(memory_runs[0].cores)
    # every plan measured afresh, interleaved: every prediction (profiled or calibrated) is out of sample
    runs = run_local_many(plans * args.rounds, RunOptions(steps=args.steps, timeout_s=timeout))
    env.record(runs[0].cores)
    last, last_alone = take_profiles(reference, args, link)
    profile, alone = merge_lockstep([first, last]), merge_lockstep([first_alone, last_alone])  # a median of 2: the mean
    rows: list[dict[str, Any]] = []
    for index, plan in enumerate(plans):
        mine = runs[index :: len(plans)]
        got = compare(plan, profile, mine)
        after = compare(plan, calibrated, mine)
        solo = compare(plan, alone, mine)
        ahead = compare(plan, first, mine)  # what a user who profiles, then runs, is told
        memory = memory_runs[index].memory
        measured_memory = [int(memory[r]["peak_bytes"]) for r in range(P)]
        memory_errors = [
            abs(p - m) / m for p, m in zip(got.predicted_memory_bytes, measured_memory, strict=True) if m > 0
        ]
        timed = list(got.timed_steps_us)
        rows.append(
            {
                "plan": plan.labels["schedule"],
                "predicted_ms": got.predicted_step_us / 1e3,
                "measured_ms": got.measured_step_us / 1e3,
                "measured_p10_ms": percentile(timed, 0.1) / 1e3,
                "measured_p90_ms": percentile(timed, 0.9) / 1e3,
                "samples": len(timed),
                "spread": got.spread,
                "replay_ms": got.replay_step_us / 1e3,
                "step_time_error": got.step_time_error,
                "signed_error": (got.predicted_step_us - got.measured_step_us) / got.measured_step_us,
                "before_ms": ahead.predicted_step_us / 1e3,
                "before_error": ahead.step_time_error,
                "alone_ms": solo.predicted_step_us / 1e3,
                "alone_error": solo.step_time_error,
                "alone_signed_error": (solo.predicted_step_us - got.measured_step_us) / got.measured_step_us,
                "calibrated_ms": after.predicted_step_us / 1e3,
                "calibrated_error": after.step_time_error,
                "calibrated_signed_error": (after.predicted_step_us - got.measured_step_us) / got.measured_step_us,
                "predicted_peak_memory_mib": [b / 2**20 for b in got.predicted_memory_bytes],
                "allocator_peak_memory_mib": [b / 2**20 for b in measured_memory],
                "allocator_detail": {str(r): memory[r] for r in range(P)},
                "memory_error": max(memory_errors) if memory_errors else None,
                "measured_over_predicted_action_time": got.slowdown,
            }
        )
    predicted = [float(r["predicted_ms"]) for r in rows]
    measured = [float(r["measured_ms"]) for r in rows]
    noise = statistics.median(float(r["spread"]) for r in rows)
    distinct = [
        (i, j)
        for i, j in itertools.combinations(range(len(rows)), 2)
        if abs(predicted[i] - predicted[j]) > noise * min(predicted[i], predicted[j])
    ]
    return {
        "workload": name,
        "profile_conditions": first.labels["conditions"],
        # the layers' times after the measured rounds against before them (lock-step, and alone)
        "profile_drift": drift(first, last),
        "profile_drift_alone": drift(first_alone, last_alone),
        "calibration": {
            "factors": {str(k): v for k, v in in_situ.factors.items()},
            "latency_us_per_run": list(in_situ.latencies_us),
            "latency_us": in_situ.latency_us,
            "probed_latency_us": link.latency_us,
            "receive_cpu_us": in_situ.receive_cpu_us,
        },
        # the goal: every fitted link latency within 2x the probe's
        "fitted_latency_over_probe": max(in_situ.latencies_us, default=0.0) / link.latency_us,
        # every term the in-situ calibration fitted, per calibration run, with its bounds
        "fitted_terms": [[term.as_dict() for term in run] for run in in_situ.fitted],
        "rows": rows,
        "noise": noise,
        "kendall_tau_all": kendall_tau(predicted, measured),
        "kendall_tau_beyond_noise": kendall_tau(predicted, measured, distinct),
        "distinct_pairs": len(distinct),
        "pairs": len(rows) * (len(rows) - 1) // 2,
    }


def print_table(link: Any, results: list[dict[str, Any]]) -> dict[str, Any]:
    print(
        f"\nsimulator fidelity: 2 gloo ranks on 2 distinct cores, m={M}; link {link.latency_us:.0f} us + "
        f"{link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    header = (
        f"{'workload':<13} {'plan':<26} {'pred ms':>8} {'meas ms [p10, p90]':>24} {'replay':>7} {'err':>7}"
        f" {'calib':>7} {'err':>7}"
    )
    print(header + f" {'mem pred/alloc MiB (max rank)':>30} {'mem err':>8}")
    step_errors, memory_errors, calibrated, alone, before = [], [], [], [], []
    for result in results:
        for r in result["rows"]:
            step_errors.append(r["step_time_error"])
            before.append(r["before_error"])
            alone.append(r["alone_error"])
            calibrated.append(r["calibrated_error"])
            if r["memory_error"] is not None:
                memory_errors.append(r["memory_error"])
            measured = f"{r['measured_ms']:.0f} [{r['measured_p10_ms']:.0f}, {r['measured_p90_ms']:.0f}]"
            memory = f"{max(r['predicted_peak_memory_mib']):.1f} / {max(r['allocator_peak_memory_mib']):.1f}"
            print(
                f"{result['workload']:<13} {r['plan']:<26} {r['predicted_ms']:>8.0f} {measured:>24} "
                f"{r['replay_ms']:>7.0f} {r['signed_error']:>+7.1%} {r['calibrated_ms']:>7.0f}"
                f" {r['calibrated_signed_error']:>+6.1%} {memory:>30}"
                f" {r['memory_error']:>8.1%}"
            )
        tau_all, tau_distinct = result["kendall_tau_all"], result["kendall_tau_beyond_noise"]
        distinct = "n/a" if tau_distinct is None else f"{tau_distinct:.2f}"
        print(
            f"{result['workload']:<13} Kendall tau {tau_all:.2f} over all {result['pairs']} pairs, {distinct} over "
            f"the {result['distinct_pairs']} whose predictions differ by more than the noise ({result['noise']:.1%}); "
            f"layer times moved {result['profile_drift']['total']:+.1%} from before to after the rounds "
            f"(alone: {result['profile_drift_alone']['total']:+.1%})"
        )
    summary = {
        "step_mape": statistics.fmean(step_errors),
        "step_mape_alone": statistics.fmean(alone),
        "step_mape_before": statistics.fmean(before),
        "calibrated_step_mape": statistics.fmean(calibrated),
        "peak_memory_mape": statistics.fmean(memory_errors) if memory_errors else None,
        "cells": len(step_errors),
        "max_fitted_latency_over_probe": max(float(r["fitted_latency_over_probe"]) for r in results),
    }
    memory = "n/a" if summary["peak_memory_mape"] is None else f"{summary['peak_memory_mape']:.1%}"
    print(
        f"MAPE over {len(step_errors)} cells: step time {summary['step_mape']:.1%} from the lock-step profiles "
        f"before and after ({summary['step_mape_before']:.1%} from the one before alone, "
        f"{summary['step_mape_alone']:.1%} from profiles taken alone), {summary['calibrated_step_mape']:.1%} "
        f"calibrated in situ (from separate runs), peak memory {memory}"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    add_arguments(parser, rounds=5, steps=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "simulator_fidelity.json")
    parser.add_argument(
        "--runtime-costs",
        type=Path,
        help="results/runtime_costs.json (bench/runtime_costs.py): the runtime's terms, put in the profile",
    )
    args = parser.parse_args()
    env = start(parser, args)
    torch.set_num_threads(1)
    link, _ = measure_link()
    results = [bench_workload(w, args, link, env) for w in args.workloads]
    summary = print_table(link, results)
    record = {
        "summary": summary,
        "sizes": "tiny" if args.tiny else "standard",
        "rounds": args.rounds,
        "steps": args.steps,
        "profiler": "lockstep",
        "runtime_costs": None if args.runtime_costs is None else str(args.runtime_costs),
        "link": {"latency_us": link.latency_us, "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second},
        "environment": env.finish(),
        "workloads": results,
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
