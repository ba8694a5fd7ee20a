"""Headline: the tuned plan against torch.distributed.pipelining's best schedule, all measured side by side.

For ``jamba-8`` and ``nemotronh-16`` (shared/benchmarks.md sizes, 2 ranks, m = 8):
profile the layers and the link on this machine, calibrate the profile in situ
(a short run of 1F1B and ZB-H1 on equal layers, ``pipeline.calibrate_in_situ``),
tune on it (partition x placement x schedule under 1F1B's memory peak; the
fastest predicted plan), then time, in every round, interleaved
(``interleave.run_rounds``), for ``--rounds`` rounds:

* every torch schedule class (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble,
  DualPipeV) with equal layer counts, on torch's own runtime;
* octopipe running each of those orders;
* the tuned plan on octopipe's runtime.

Every launch: 2 ranks pinned to 2 distinct cores (checked), one thread each, the
same host allocator policy on both sides (``transform.host_memory``), the first
``--warmup`` steps (default 1) warm-up: a plan that holds more activations (ZB-H1's
stashed W inputs) reaches the allocator's steady state a step or two later. torch's best is the schedule with the lowest median over all
rounds; the headline ratio is torch's best median step / the tuned plan's (a
throughput ratio: above 1, the tuned plan is faster), with a two-level bootstrap
90% interval in which the best torch schedule is chosen again in every draw.
Also reported: the zero-bubble limit (every layer's F + B + W from the profile,
x m / p) and each same-order ratio, which are also merged into
``results/vs_torch.json`` (``vs_torch_compiled.json`` compiled) for these
workloads: the same launches, so one run gives both views.

``--compile inductor``: the profile, the calibration and every octopipe launch
compile their stage graphs with Inductor; torch's layer modules are compiled in
place (``module.compile()``, as torchtitan does). A torch schedule that cannot
run compiled blocks is recorded with its error's first line and runs eagerly in
every round (its eager time then stands in for it in torch's best). Written under
``compiled`` in the same JSON, beside the eager figures.

    .venv/bin/python bench/headline.py [--workloads jamba-8 nemotronh-16] [--rounds 5] [--steps 3] [--warmup 1] [--compile inductor]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from interleave import Candidate, Measured, best_ratio_interval, first_line, run_rounds, summary
from quiet import Environment, add_arguments, start
from torch_pp import SCHEDULES, run_torch
from vs_torch import M, merge_workloads, octopipe_candidate, run_record, same_order_plan, same_order_rows

from octopipe.execute.runtime import RunOptions, run_local_many, workload_reference
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.pipeline import calibrate_in_situ, layer_names, profile_reference, tune_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import StageCompiler
from octopipe.tune import TuneConfig, equal_partition, one_f_one_b, zb_h1

P = 2


def torch_candidate(
    name: str, reference: plan_pb2.ModelReference, args: argparse.Namespace, env: Environment, notes: dict[str, str]
) -> Candidate:
    """torch's ``name``; compiled blocks with ``--compile inductor``, eager from the first failure on."""

    def run() -> list[float]:
        compiled = args.compile == "inductor" and name not in notes
        try:
            times, cores = run_torch(name, reference, M, args.steps, compile_blocks=compiled)
        except Exception as exc:
            if not compiled:
                raise
            notes[name] = first_line(exc)
            print(f"  torch {name} cannot run compiled blocks ({notes[name]}): eager from now on", flush=True)
            times, cores = run_torch(name, reference, M, args.steps)
        env.record(cores)
        return times[args.warmup :]

    return Candidate(f"torch {name}", run)


def tuned_plan(reference: plan_pb2.ModelReference, args: argparse.Namespace, env: Environment) -> dict[str, Any]:
    """Profile, calibrate in situ, tune: the plan and what the tuner said about it."""
    compile_ = "inductor" if args.compile == "inductor" else "eager"
    timeout = 120.0 if args.tiny else 900.0
    link, _ = measure_link()
    compiler = StageCompiler(backend="inductor") if compile_ == "inductor" else None
    profile = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link, compiler=compiler)
    names = layer_names(reference)
    sources = [schedule(P, M, layer_names=equal_partition(names, P)) for schedule in (one_f_one_b, zb_h1)] * 2
    for source in sources:
        source.model.CopyFrom(reference)
    calibration = run_local_many(sources, RunOptions(steps=args.steps, timeout_s=timeout, compile=compile_))
    env.record(calibration[0].cores)
    in_situ = calibrate_in_situ(profile, list(zip(sources, calibration, strict=True)))
    tuned = tune_reference(in_situ.profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=60.0))
    limit_us = sum(
        c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us for c in profile.layers
    ) * (M / P)
    return {
        "plan": tuned.plan,
        "description": tuned.description,
        "predicted_ms": tuned.estimate.step_time_us / 1e3,
        "predicted_speedup_over_1f1b": tuned.speedup,
        "calibrated_latency_us": in_situ.latency_us,
        "probed_latency_us": link.latency_us,
        "calibrated_receive_cpu_us": in_situ.receive_cpu_us,
        "fitted_terms": [[term.as_dict() for term in run] for run in in_situ.fitted],
        "zero_bubble_limit_ms": limit_us / 1e3,
    }


def bench(workload: str, args: argparse.Namespace, env: Environment) -> dict[str, Any]:
    reference = workload_reference(workload, tiny=True, sequence=16) if args.tiny else workload_reference(workload)
    compile_ = "inductor" if args.compile == "inductor" else "eager"
    print(f"\n{workload}: profiling, calibrating and tuning ...", flush=True)
    tuned = tuned_plan(reference, args, env)
    print(f"  tuned: {tuned['description']} (predicted {tuned['predicted_speedup_over_1f1b']:.3f}x over 1F1B)")
    notes: dict[str, str] = {}
    candidates = [torch_candidate(name, reference, args, env, notes) for name in SCHEDULES]
    candidates += [
        octopipe_candidate(f"octopipe {name}", same_order_plan(name, reference), args, env, compile_)
        for name in SCHEDULES
    ]
    candidates.append(octopipe_candidate("octopipe tuned", tuned["plan"], args, env, compile_))
    measured = {m.name: m for m in run_rounds(candidates, args.rounds)}
    theirs: list[Measured] = [measured[f"torch {name}"] for name in SCHEDULES]
    ours = measured["octopipe tuned"]
    usable = [m for m in theirs if m.launches]
    best = min(usable, key=lambda m: m.median_us)
    low, high = best_ratio_interval(theirs, ours)
    same_order = same_order_rows(measured, SCHEDULES)
    for row in same_order:  # compiled octopipe against eager torch is not a same-order figure
        if row["schedule"] in notes:
            row["torch_failed"] = notes[row["schedule"]]
            row["torch_ran_eager"] = True
            row.pop("ratio", None)
            row.pop("ratio_ci90", None)
    plan = tuned.pop("plan")
    return {
        "tuned": tuned["description"],
        **tuned,
        "plan_actions": [[str(a) for a in r.actions] for r in plan.ranks],
        "measured": {name: summary(m) for name, m in measured.items()},
        "torch_compiled_failures": notes,
        "torch_best": best.name.removeprefix("torch "),
        "ratio": best.median_us / ours.median_us,
        "ratio_ci90": [low, high],
        "tuned_over_zero_bubble_limit": ours.median_us / 1e3 / tuned["zero_bubble_limit_ms"],
        "same_order_octopipe_over_torch": same_order,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["jamba-8", "nemotronh-16"])
    parser.add_argument("--compile", choices=["eager", "inductor"], default="eager")
    add_arguments(parser, rounds=5, steps=3, warmup=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "headline.json")
    args = parser.parse_args()
    env = start(parser, args)
    torch.set_num_threads(1)
    workloads = {w: bench(w, args, env) for w in args.workloads}
    print(f"\nheadline ({args.compile}): tuned plan vs torch.distributed.pipelining's best, 2 ranks, m={M}")
    for w, r in workloads.items():
        print(f"{w}: tuned = {r['tuned']} (predicted {r['predicted_speedup_over_1f1b']:.3f}x over 1F1B)")
        for name, s in r["measured"].items():
            cell = f"{s['median_ms']:>8.0f} ms [{s['p10_ms']:.0f}, {s['p90_ms']:.0f}]" if s.get("samples") else "failed"
            print(f"  {name:<36} {cell}")
        for name, note in r["torch_compiled_failures"].items():
            print(f"  torch {name} ran eagerly: compiled blocks failed: {note}")
        print(
            f"  throughput, tuned vs torch's best ({r['torch_best']}): {r['ratio']:.3f}x "
            f"[90% CI {r['ratio_ci90'][0]:.3f}, {r['ratio_ci90'][1]:.3f}]; tuned / zero-bubble limit "
            f"{r['tuned_over_zero_bubble_limit']:.3f}"
        )
    run = run_record(env, args, "bench/headline.py", host_memory="reuse (both sides)")
    part = {**run, "tiny": args.tiny, "workloads": workloads}
    # the eager figures at the top level, the compiled ones under "compiled": one file, each part kept
    record: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.compile == "inductor":
        record["compiled"] = part
    else:
        record = {**part, **({"compiled": record["compiled"]} if "compiled" in record else {})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out}")
    same_order = {w: r["same_order_octopipe_over_torch"] for w, r in workloads.items()}
    vs_torch = args.out.parent / ("vs_torch_compiled.json" if args.compile == "inductor" else "vs_torch.json")
    merge_workloads(vs_torch, same_order, run, compile_=args.compile, tiny=args.tiny)


if __name__ == "__main__":
    main()
