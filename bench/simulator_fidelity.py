"""Simulator fidelity: profile -> simulate -> run, and how far the prediction is from the measurement.

For each workload (shared/benchmarks.md sizes, 2 ranks, m = 8, equal layer
counts per stage) and each schedule: profile the layers on this machine (one
pinned thread) and the gloo link, simulate the plan, run it on 2 pinned gloo
ranks for ``--steps`` steps (the first is warm-up), and compare:

- step time: simulated vs the median measured step;
- peak activation memory per rank: simulated vs the most bytes the runtime held
  (activations, gradients in flight, messages; parameters, gradients and
  optimizer state are exact on both sides and left out);
- rank order of the schedules by step time (Kendall tau);
- runtime overhead: measured step time / the simulator's step time when fed the
  measured per-action durations (what the runtime adds around the compute).

The measurement's own run-to-run spread is the (p90 - p10) / median of its steps.

    .venv/bin/python bench/simulator_fidelity.py [--workloads llama-8 jamba-8 nemotronh-16] [--steps 4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from octopipe.execute.linkprobe import measure_link
from octopipe.execute.pipeline import compare, layer_names, profile_reference
from octopipe.execute.runtime import run_local_many, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, gpipe, interleaved_1f1b, one_f_one_b, zb_h1

M = 8


def plans_for(reference: plan_pb2.ModelReference, names: list[str]) -> list[plan_pb2.Plan]:
    plans = [
        gpipe(2, M, layer_names=equal_partition(names, 2)),
        one_f_one_b(2, M, layer_names=equal_partition(names, 2)),
        zb_h1(2, M, layer_names=equal_partition(names, 2)),
        interleaved_1f1b(2, 2, M, layer_names=equal_partition(names, 4)),
    ]
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum(
        1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0 for i, j in pairs
    )
    return score / len(pairs)


def bench_workload(name: str, steps: int, link: Any, *, tiny: bool = False) -> dict[str, Any]:
    reference = workload_reference(name, tiny=True, sequence=16) if tiny else workload_reference(name)
    profile = profile_reference(reference, num_microbatches=M, num_ranks=2, link=link)
    plans = plans_for(reference, layer_names(reference))
    results = run_local_many(plans, steps=steps, timeout_s=600)
    rows = []
    for plan, result in zip(plans, results, strict=True):
        got = compare(plan, profile, [result])
        memory_errors = [
            abs(p - h) / h
            for p, h in zip(got.predicted_activation_bytes, got.measured_activation_bytes, strict=True)
            if h > 0
        ]
        rows.append(
            {
                "schedule": plan.labels["schedule"],
                "simulated_ms": got.predicted_step_us / 1e3,
                "measured_ms": got.measured_step_us / 1e3,
                "measured_spread": got.spread,
                "step_time_error": got.step_time_error,
                "simulated_peak_activation_mib": [b / 2**20 for b in got.predicted_activation_bytes],
                "measured_peak_held_mib": [b / 2**20 for b in got.measured_activation_bytes],
                "memory_error": statistics.fmean(memory_errors),
                "replay_ms": got.replay_step_us / 1e3,
                "runtime_overhead": got.measured_step_us / got.replay_step_us,
            }
        )
    tau = kendall_tau([float(r["simulated_ms"]) for r in rows], [float(r["measured_ms"]) for r in rows])  # type: ignore[arg-type]
    return {"workload": name, "rows": rows, "kendall_tau": tau}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["llama-8", "jamba-8", "nemotronh-16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="unit-test sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "simulator_fidelity.json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    link, _ = measure_link()
    results = [bench_workload(w, args.steps, link, tiny=args.tiny) for w in args.workloads]
    print(
        f"simulator fidelity: 2 gloo ranks, m={M}, link {link.latency_us:.0f} us + {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    print(
        f"{'workload':<14} {'schedule':<20} {'sim ms':>8} {'meas ms':>8} {'spread':>7} {'err':>6} {'act err':>8} {'overhead':>9}"
    )
    step_errors, memory_errors = [], []
    for result in results:
        for r in result["rows"]:
            step_errors.append(r["step_time_error"])
            memory_errors.append(r["memory_error"])
            print(
                f"{result['workload']:<14} {r['schedule']:<20} {r['simulated_ms']:>8.0f} {r['measured_ms']:>8.0f} "
                f"{r['measured_spread']:>7.1%} {r['step_time_error']:>6.1%} {r['memory_error']:>8.1%} {r['runtime_overhead']:>9.3f}"
            )
        print(f"{result['workload']:<14} Kendall tau (schedule order) {result['kendall_tau']:.2f}")
    summary = {
        "step_time_mape": statistics.fmean(step_errors),
        "activation_memory_mape": statistics.fmean(memory_errors),
    }
    print(
        f"MAPE step time {summary['step_time_mape']:.1%}, peak activation memory {summary['activation_memory_mape']:.1%}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "workloads": results}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
