"""Tuner wall time for 128 layers, p = 16, m = 64, on one core (goal: <= 30 s).

The 128 layers: the embedding, 126 Jamba-pattern layers (costs of bench/tune_workloads.py) and the
head. Default configuration (all placement families, 30 s budget, one random restart). The process
is pinned to one core; wall and CPU time per run, median and spread over seeds.

    .venv/bin/python bench/tune_speed.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tune_workloads import workload_profile

from octopipe.tune import TuneConfig, tune

OUT = Path(__file__).parent / "results" / "tune_speed.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    jamba = workload_profile("jamba-32")
    profile = workload_profile("jamba-32")
    del profile.layers[:]
    body = [layer for layer in jamba.layers if layer.layer_name.startswith("layers.")]
    profile.layers.append(jamba.layers[0])
    for index in range(126):
        layer = profile.layers.add()
        layer.CopyFrom(body[index % len(body)])
        layer.layer_name = f"layers.{index}"
    profile.layers.append(jamba.layers[-1])
    assert len(profile.layers) == 128
    runs = []
    walls: list[float] = []
    print(f"{'seed':>4} {'wall s':>7} {'cpu s':>7} {'sims':>5} {'stopped':>12} {'x 1F1B':>7}  plan")
    for seed in range(args.runs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = tune(profile, TuneConfig(num_ranks=16, num_microbatches=64, seed=seed))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        walls.append(wall)
        runs.append(
            {
                "seed": seed,
                "wall_s": wall,
                "cpu_s": cpu,
                "evaluations": result.evaluations,
                "stopped": result.stopped,
                "speedup_vs_1f1b_equal": result.speedup,
                "plan": result.description,
            }
        )
        print(
            f"{seed:4d} {wall:7.1f} {cpu:7.1f} {result.evaluations:5d} {result.stopped:>12} {result.speedup:7.3f}  "
            f"{result.description[:70]}",
            flush=True,
        )
    walls.sort()
    summary = {"median_wall_s": statistics.median(walls), "min_wall_s": walls[0], "max_wall_s": walls[-1]}
    print(f"median {summary['median_wall_s']:.1f} s (min {walls[0]:.1f}, max {walls[-1]:.1f}); goal <= 30 s")
    meta = {"script": "bench/tune_speed.py", "python": sys.version.split()[0], "machine": platform.machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
