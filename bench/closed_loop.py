"""The closed loop from the tuner's own plan: predicted and measured gain after calibration.

For each workload (2 ranks, m = 8): profile the layers and the link, tune (the
fastest predicted plan: ``min_gain`` 0, so the loop has something to correct),
run that plan ``--steps`` steps, then do what the coordinator's closed loop does
after its first steps (``octopipe.tune.retune``: calibrate the profile with the
run's measured timelines, re-schedule the same stages on the same ranks, pick the
best predicted candidate, switching when it is predicted ``MIN_ADAPT_GAIN`` faster). If it switches, the running plan and the new one run
alternately (A B A B, ``--rounds`` each, ``--steps`` steps per launch, the first
of each launch is warm-up) and the measured gain is the ratio of their median
steps; the predicted gain is ``Retune.predicted_gain`` (calibrated costs). Every
launch pins its 2 ranks to 2 distinct cores; refuses a busy machine unless
``--force``.

    .venv/bin/python bench/closed_loop.py [--workloads llama-8 jamba-8 nemotronh-16] [--rounds 5] [--steps 11]
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

from octopipe.execute.control.coordinator import MIN_ADAPT_GAIN
from octopipe.execute.runtime import (
    RunOptions,
    measured_step_times_us,
    run_local,
    run_local_many,
    timelines_to_proto,
    workload_reference,
)
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.pipeline import profile_reference, tune_reference
from octopipe.tune import TuneConfig, retune

M, P = 8, 2


def bench(name: str, args: argparse.Namespace, env: Environment) -> dict[str, Any]:
    reference = workload_reference(name, tiny=True, sequence=16) if args.tiny else workload_reference(name)
    link, _ = measure_link()
    profile = profile_reference(reference, num_microbatches=M, num_ranks=P, link=link)
    tuned = tune_reference(profile, TuneConfig(num_ranks=P, num_microbatches=M, time_budget_s=30.0))
    first = run_local(tuned.plan, RunOptions(steps=args.steps, timeout_s=900.0))
    env.record(first.cores)
    timelines = [t for t in timelines_to_proto(first) if t.step > 0]  # the loop, like the coordinator, skips warm-up
    loop = retune(tuned.plan, profile, timelines)
    row: dict[str, Any] = {
        "workload": name,
        "tuned": tuned.description,
        "tuned_predicted_ms": tuned.estimate.step_time_us / 1e3,
        "first_run": step_summary(measured_step_times_us(first)[1:]),
        "switched_to": loop.name,
        "calibrated_current_ms": loop.current_us / 1e3,
        "calibrated_best_ms": loop.best_us / 1e3,
        "predicted_gain": loop.predicted_gain,
        "min_adapt_gain": MIN_ADAPT_GAIN,
    }
    if loop.name == "current" or loop.predicted_gain < MIN_ADAPT_GAIN:  # the coordinator's rule
        row["measured_gain"] = None
        return row
    times: dict[str, list[float]] = {"current": [], "switched": []}
    for _ in range(args.rounds):
        runs = run_local_many([tuned.plan, loop.plan], RunOptions(steps=args.steps, timeout_s=900.0))
        for key, run in zip(("current", "switched"), runs, strict=True):
            env.record(run.cores)
            times[key] += measured_step_times_us(run)[1:]
    row["current"] = step_summary(times["current"])
    row["switched"] = step_summary(times["switched"])
    row["measured_gain"] = statistics.median(times["current"]) / statistics.median(times["switched"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["llama-8", "jamba-8", "nemotronh-16"])
    add_arguments(parser, rounds=5, steps=11)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "closed_loop.json")
    args = parser.parse_args()
    env = start(parser, args)
    torch.set_num_threads(1)
    rows = [bench(w, args, env) for w in args.workloads]
    size = "tiny sizes (smoke run, not a result)" if args.tiny else "standard sizes"
    print(f"\nclosed loop from the tuner's own plan, 2 ranks, m={M}, {size}")
    for r in rows:
        print(f"{r['workload']}: tuned = {r['tuned']} (predicted {r['tuned_predicted_ms']:.1f} ms)")
        print(f"  first run {r['first_run']['median_ms']:.1f} ms; after calibration: {r['switched_to']}")
        if r["measured_gain"] is None:
            print(f"  the loop keeps the running plan (best predicted gain {r['predicted_gain']:.3f}x)")
            continue
        c, s = r["current"], r["switched"]
        print(
            f"  running {c['median_ms']:.1f} ms [{c['p10_ms']:.1f}, {c['p90_ms']:.1f}], switched "
            f"{s['median_ms']:.1f} ms [{s['p10_ms']:.1f}, {s['p90_ms']:.1f}] ({s['samples']} steps each): "
            f"gain predicted {r['predicted_gain']:.3f}x, measured {r['measured_gain']:.3f}x"
        )
    record = {"environment": env.finish(), "rounds": args.rounds, "steps": args.steps, "workloads": rows}
    write_record(args.out, record)


if __name__ == "__main__":
    main()
