"""Headline: the tuned plan vs torch.distributed.pipelining's best schedule, on heterogeneous workloads.

For ``jamba-8`` and ``nemotronh-16`` (shared/benchmarks.md sizes, 2 ranks, m = 8):
profile the layers and the link on this machine, tune (partition x placement x
schedule under 1F1B's memory peak), run the tuned plan with octopipe, and run
every torch schedule class (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble,
DualPipeV) with equal layer counts per stage on torch's own runtime. Reports the
throughput ratio tuned / torch's best, and the tuned step time against the
zero-bubble limit: the sum of every layer's F + B + W (from the same profile)
x m / p. Launches run one after another; each gives ``--steps`` steps, the
first is warm-up; medians and 10th-90th percentiles.

    .venv/bin/python bench/headline.py [--workloads jamba-8 nemotronh-16] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from vs_torch import SCHEDULES, percentile, run_torch

from octopipe.execute.linkprobe import measure_link
from octopipe.execute.pipeline import profile_reference, tune_reference
from octopipe.execute.runtime import measured_step_times_us, run_local, workload_reference
from octopipe.tune import TuneConfig

M, P = 8, 2


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(values) / 1e3,
        "p10_ms": percentile(values, 0.1) / 1e3,
        "p90_ms": percentile(values, 0.9) / 1e3,
    }


def bench(name: str, steps: int, tiny: bool) -> dict[str, Any]:
    reference = workload_reference(name, tiny=True, sequence=16) if tiny else workload_reference(name)
    link, _ = measure_link()
    profile = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link)
    tuned = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M))
    plan = tuned.plan
    ours = measured_step_times_us(run_local(plan, steps=steps, timeout_s=900))[1:]
    torch_runs = {schedule: run_torch(schedule, reference, M, steps)[1:] for schedule in SCHEDULES}
    best_name = min(torch_runs, key=lambda s: statistics.median(torch_runs[s]))
    limit_us = (
        sum(
            c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us for c in profile.layers
        )
        * M
        / P
    )
    return {
        "workload": name,
        "tuned": tuned.description,
        "tuned_predicted_ms": tuned.estimate.step_time_us / 1e3,
        "predicted_speedup_over_1f1b": tuned.speedup,
        "ours": summary(ours),
        "torch": {s: summary(v) for s, v in torch_runs.items()},
        "torch_best": best_name,
        "throughput_ratio_vs_torch_best": statistics.median(torch_runs[best_name]) / statistics.median(ours),
        "zero_bubble_limit_ms": limit_us / 1e3,
        "tuned_over_limit": statistics.median(ours) / limit_us,
        "plan": [[str(a) for a in r.actions] for r in plan.ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["jamba-8", "nemotronh-16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="unit-test sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "headline.json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    rows = [bench(w, args.steps, args.tiny) for w in args.workloads]
    print(f"\nheadline: tuned plan vs torch.distributed.pipelining's best (equal layer counts), 2 ranks, m={M}")
    for r in rows:
        print(f"{r['workload']}: tuned = {r['tuned']} (predicted {r['predicted_speedup_over_1f1b']:.3f}x over 1F1B)")
        for schedule, s in r["torch"].items():
            print(f"  torch {schedule:<28} {s['median_ms']:>8.0f} ms [{s['p10_ms']:.0f}, {s['p90_ms']:.0f}]")
        o = r["ours"]
        print(f"  octopipe tuned{'':<21} {o['median_ms']:>8.0f} ms [{o['p10_ms']:.0f}, {o['p90_ms']:.0f}]")
        print(
            f"  throughput vs torch's best ({r['torch_best']}): {r['throughput_ratio_vs_torch_best']:.3f}x;"
            f" zero-bubble limit {r['zero_bubble_limit_ms']:.0f} ms, tuned / limit {r['tuned_over_limit']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
