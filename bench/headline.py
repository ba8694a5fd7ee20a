"""Headline: the tuned plan vs torch.distributed.pipelining's best schedule, on heterogeneous workloads.

For ``jamba-8`` and ``nemotronh-16`` (shared/benchmarks.md sizes, 2 ranks, m = 8):
profile the layers and the link on this machine, calibrate the profile in situ
(a short run of 1F1B and ZB-H1, ``pipeline.calibrate_in_situ``), tune on it
(partition x placement x schedule under 1F1B's memory peak; the fastest
predicted plan, and the plan chosen with ``--min-gain``), then measure, every
launch with its 2 ranks pinned to 2 distinct cores:

* round 1: every torch schedule class (GPipe, 1F1B, Interleaved1F1B,
  ZBVZeroBubble, DualPipeV) with equal layer counts on torch's own runtime,
  and the tuned plan on octopipe's;
* rounds 2..``--rounds``: the tuned plan and torch's best of round 1,
  alternating (A B A B), so drift touches both alike.

Each launch runs ``--steps`` steps; the first is warm-up. Reports medians and
10th-90th percentiles, the throughput ratio tuned / torch's best, and the
tuned step against the zero-bubble limit (every layer's F + B + W from the
same profile x m / p). Refuses a busy machine unless ``--force``.

    .venv/bin/python bench/headline.py [--workloads jamba-8 nemotronh-16] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, add_arguments, start, step_summary, write_record
from vs_torch import SCHEDULES, run_torch

from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local, run_local_many, workload_reference
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.pipeline import calibrate_in_situ, layer_names, profile_reference, tune_reference
from octopipe.tune import TuneConfig, equal_partition, one_f_one_b, zb_h1

M, P = 8, 2


def bench(name: str, args: argparse.Namespace, env: Environment) -> dict[str, Any]:
    reference = workload_reference(name, tiny=True, sequence=16) if args.tiny else workload_reference(name)
    link, _ = measure_link()
    profile = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link)
    timeout = 120.0 if args.tiny else 900.0
    # calibrate in situ (a short run of 1F1B and ZB-H1 on equal layers), then tune on the calibrated profile
    names = layer_names(reference)
    sources = [schedule(P, M, layer_names=equal_partition(names, P)) for schedule in (one_f_one_b, zb_h1)] * 2
    for source in sources:
        source.model.CopyFrom(reference)
    calibration_runs = run_local_many(sources, RunOptions(steps=args.steps, timeout_s=timeout))
    env.record(calibration_runs[0].cores)
    in_situ = calibrate_in_situ(profile, list(zip(sources, calibration_runs, strict=True)))
    uncalibrated = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=60.0))
    tuned = tune_reference(in_situ.profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=60.0))
    chosen = tune_reference(
        in_situ.profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=60.0, min_gain=args.min_gain)
    )
    plan = tuned.plan

    def ours() -> list[float]:
        run = run_local(plan, RunOptions(steps=args.steps, timeout_s=timeout))
        env.record(run.cores)
        return measured_step_times_us(run)[1:]

    def theirs(schedule: str) -> list[float]:
        times, cores = run_torch(schedule, reference, M, args.steps)
        env.record(cores)
        return times[1:]

    measured: dict[str, list[float]] = {"octopipe": ours()}
    torch_runs = {schedule: theirs(schedule) for schedule in SCHEDULES}
    best_name = min(torch_runs, key=lambda s: statistics.median(torch_runs[s]))
    for _ in range(args.rounds - 1):
        measured["octopipe"] += ours()
        torch_runs[best_name] += theirs(best_name)
    limit_us = (
        sum(
            c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us for c in profile.layers
        )
        * M
        / P
    )
    ours_median = statistics.median(measured["octopipe"])
    return {
        "workload": name,
        "tuned": tuned.description,
        "tuned_predicted_ms": tuned.estimate.step_time_us / 1e3,
        "predicted_speedup_over_1f1b": tuned.speedup,
        "tuned_on_the_uncalibrated_profile": {"plan": uncalibrated.description, "speedup": uncalibrated.speedup},
        "calibration": {"latency_us": in_situ.latency_us, "probed_latency_us": link.latency_us},
        "chosen_with_min_gain": {"min_gain": args.min_gain, "plan": chosen.description, "why": chosen.choice},
        "link": {"latency_us": link.latency_us, "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second},
        "ours": step_summary(measured["octopipe"]),
        "torch": {s: step_summary(v) for s, v in torch_runs.items()},
        "torch_best": best_name,
        "throughput_ratio_vs_torch_best": statistics.median(torch_runs[best_name]) / ours_median,
        "zero_bubble_limit_ms": limit_us / 1e3,
        "tuned_over_limit": ours_median / limit_us,
        "plan": [[str(a) for a in r.actions] for r in plan.ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["jamba-8", "nemotronh-16"])
    parser.add_argument("--min-gain", type=float, default=0.05, help="also report the plan chosen with this error")
    add_arguments(parser, rounds=5, steps=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "headline.json")
    args = parser.parse_args()
    env = start(parser, args)
    torch.set_num_threads(1)
    rows = [bench(w, args, env) for w in args.workloads]
    print(f"\nheadline: tuned plan vs torch.distributed.pipelining's best (equal layer counts), 2 ranks, m={M}")
    for r in rows:
        print(
            f"{r['workload']}: tuned = {r['tuned']} (predicted {r['predicted_speedup_over_1f1b']:.3f}x over 1F1B, "
            f"calibrated link latency {r['calibration']['latency_us']:.0f} us vs probed "
            f"{r['calibration']['probed_latency_us']:.0f} us)"
        )
        print(f"  with --min-gain {args.min_gain}: {r['chosen_with_min_gain']['why']}")
        for schedule, s in r["torch"].items():
            print(
                f"  torch {schedule:<28} {s['median_ms']:>8.0f} ms [{s['p10_ms']:.0f}, {s['p90_ms']:.0f}]"
                f" ({s['samples']} steps)"
            )
        o = r["ours"]
        print(
            f"  octopipe tuned{'':<21} {o['median_ms']:>8.0f} ms [{o['p10_ms']:.0f}, {o['p90_ms']:.0f}]"
            f" ({o['samples']} steps)"
        )
        print(
            f"  throughput vs torch's best ({r['torch_best']}): {r['throughput_ratio_vs_torch_best']:.3f}x;"
            f" zero-bubble limit {r['zero_bubble_limit_ms']:.0f} ms, tuned / limit {r['tuned_over_limit']:.3f}"
        )
    record = {"environment": env.finish(), "rounds": args.rounds, "steps": args.steps, "workloads": rows}
    write_record(args.out, record)


if __name__ == "__main__":
    main()
