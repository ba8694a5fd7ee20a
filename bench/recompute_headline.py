"""Two real ranks at 60% of 1F1B's peak: the tuned plan (recomputation searched) against torch's 1F1B with
torch's own activation checkpointing.

For ``nemotronh-16`` and ``jamba-8`` (shared/benchmarks.md sizes, 2 ranks, m = 8): profile the layers
saving everything and under ``layers`` and ``budget:0.5`` (``profile_reference(recompute=...)``) and the
link; take 1F1B's predicted peak on equal layers; tune under ``--fraction`` (0.6) of it
(``tune_reference``, every policy the profile has searched per stage); then time, interleaved
(``interleave.run_rounds``), for ``--rounds`` rounds: torch's ``Schedule1F1B`` with every decoder layer
under ``torch.utils.checkpoint`` (the way a torch user fits 1F1B under that budget), torch's
``Schedule1F1B`` saving everything (for scale; it does not fit the budget), and the tuned plan on
octopipe's runtime. Ratio: torch's AC median step / the tuned plan's (above 1: the tuned plan is faster),
with the bootstrap 90% interval. Every launch: 2 ranks on 2 distinct cores (checked), one thread each,
the same host allocator policy on both sides.

    .venv/bin/python bench/recompute_headline.py [--workloads nemotronh-16 jamba-8] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from interleave import Candidate, ratio_interval, run_rounds, summary
from quiet import Environment, add_arguments, start
from torch_pp import run_torch
from vs_torch import M, octopipe_candidate, run_record

from octopipe.capture import CaptureConfig
from octopipe.execute.runtime import workload_reference
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.pipeline import profile_reference, tune_reference
from octopipe.ir import recompute_of
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import TuneConfig

P = 2


def torch_1f1b(reference: plan_pb2.ModelReference, args: argparse.Namespace, env: Environment, ac: bool) -> Candidate:
    def run() -> list[float]:
        times, cores = run_torch("Schedule1F1B", reference, M, args.steps, checkpoint_layers=ac)
        env.record(cores)
        return times[args.warmup :]

    return Candidate("torch 1F1B + AC" if ac else "torch 1F1B (saves all)", run)


def bench(workload: str, args: argparse.Namespace, env: Environment) -> dict[str, Any]:
    reference = workload_reference(workload, tiny=True, sequence=16) if args.tiny else workload_reference(workload)
    print(f"\n{workload}: profiling (saving, layers, budget:0.5) and tuning ...", flush=True)
    link, _ = measure_link()
    configs = [CaptureConfig(recompute="layers"), CaptureConfig(recompute="budget", activation_budget=0.5)]
    profile = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link, recompute=configs)
    full = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M, recompute=("none",), kicks=0))
    peak = max(full.memory_caps.values())  # 1F1B's predicted peak on equal layers
    cap = int(peak * args.fraction)
    tuned = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M, memory_cap_bytes=cap, time_budget_s=60))
    print(f"  1F1B peak {peak / 2**20:.1f} MiB, budget {cap / 2**20:.1f} MiB: {tuned.description}", flush=True)
    candidates = [
        torch_1f1b(reference, args, env, ac=True),
        torch_1f1b(reference, args, env, ac=False),
        octopipe_candidate("octopipe tuned", tuned.plan, args, env, "eager"),
    ]
    measured = {m.name: m for m in run_rounds(candidates, args.rounds)}
    theirs, ours = measured["torch 1F1B + AC"], measured["octopipe tuned"]
    low, high = ratio_interval(theirs, ours)
    return {
        "one_f_one_b_peak_bytes": peak,
        "budget_bytes": cap,
        "budget_fraction": args.fraction,
        "tuned": tuned.description,
        "tuned_recompute": [recompute_of(stage).label for stage in tuned.plan.stages],
        "tuned_predicted_ms": tuned.estimate.step_time_us / 1e3,
        "tuned_predicted_peak_bytes": [r.peak_memory_bytes for r in tuned.estimate.ranks],
        "plan_actions": [[str(a) for a in r.actions] for r in tuned.plan.ranks],
        "measured": {name: summary(m) for name, m in measured.items()},
        "ratio_vs_torch_1f1b_ac": theirs.median_us / ours.median_us,
        "ratio_ci90": [low, high],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["nemotronh-16", "jamba-8"])
    parser.add_argument("--fraction", type=float, default=0.6, help="the budget, of 1F1B's predicted peak")
    add_arguments(parser, rounds=5, steps=3, warmup=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "recompute_headline.json")
    args = parser.parse_args()
    env = start(parser, args)
    torch.set_num_threads(1)
    workloads = {w: bench(w, args, env) for w in args.workloads}
    print(f"\ntuned plan under {args.fraction:.0%} of 1F1B's peak vs torch 1F1B + activation checkpointing, 2 ranks")
    for w, r in workloads.items():
        print(f"{w}: {r['tuned']}")
        for name, s in r["measured"].items():
            cell = f"{s['median_ms']:>8.0f} ms [{s['p10_ms']:.0f}, {s['p90_ms']:.0f}]" if s.get("samples") else "failed"
            print(f"  {name:<28} {cell}")
        print(f"  ratio {r['ratio_vs_torch_1f1b_ac']:.3f}x [90% CI {r['ratio_ci90'][0]:.3f}, {r['ratio_ci90'][1]:.3f}]")
    record = {**run_record(env, args, "bench/recompute_headline.py", host_memory="reuse (both sides)")}
    record |= {"tiny": args.tiny, "workloads": workloads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
