"""Allocator peak against the simulator's prediction, under each recomputation policy.

For each workload (standard sizes, global batch 16, m = 4, the 2-stage equal
partition) it profiles the layers saving and under ``layers`` and
``budget:0.5`` (``ProfilerConfig.recompute``), runs 1F1B and ZB-H1 with every
stage under each policy on 2 gloo ranks (``measure_memory``: the allocator's
peak per rank), and prints predicted against measured. Sizes, not times: the
machine's load does not move them.

    .venv/bin/python bench/recompute_memory.py [--workloads llama-8 nemotronh-16] [--out bench/results/recompute_memory.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, require_quiet, write_record

from octopipe.capture import CaptureConfig
from octopipe.execute.runtime import RunOptions, run_local_many, workload_reference
from octopipe.execute.runtime.pipeline import compare, layer_names, profile_reference
from octopipe.ir import Recompute, with_recompute
from octopipe.tune import equal_partition, one_f_one_b, zb_h1

M = 4
POLICIES = ("none", "layers", "budget:0.5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["llama-8", "nemotronh-16"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/recompute_memory.json"))
    args = parser.parse_args()
    require_quiet()
    env = Environment()
    rows = []
    for name in args.workloads:
        reference = workload_reference(name, global_batch=16)
        configs = [CaptureConfig(recompute="layers"), CaptureConfig(recompute="budget", activation_budget=0.5)]
        profile = profile_reference(reference, num_microbatches=M, repeats=1, recompute=configs)
        partition = equal_partition(layer_names(reference), 2)
        plans = {}
        for schedule, make in (("1f1b", one_f_one_b), ("zb-h1", zb_h1)):
            base = make(2, M, layer_names=partition)
            base.model.CopyFrom(reference)
            for policy in POLICIES:
                parsed = Recompute.parse(policy)
                plans[(schedule, policy)] = with_recompute(base, {0: parsed, 1: parsed})
        runs = run_local_many(list(plans.values()), RunOptions(steps=2, measure_memory=True, timeout_s=600))
        for (schedule, policy), run in zip(plans, runs, strict=True):
            env.record(run.cores)
            result = compare(plans[(schedule, policy)], profile, [run])
            predicted = [r.peak_memory_bytes for r in result.simulation.estimate.ranks]
            measured = list(result.allocator_memory_bytes)
            errors = [(p - q) / q for p, q in zip(predicted, measured, strict=True)]
            rows.append(
                {"workload": name, "schedule": schedule, "policy": policy, "predicted_bytes": predicted,
                 "allocator_peak_bytes": measured, "error": errors}
            )  # fmt: skip
            shown = " ".join(
                f"{p / 2**20:7.1f}/{q / 2**20:7.1f} ({e:+.1%})"
                for p, q, e in zip(predicted, measured, errors, strict=True)
            )
            print(f"{name:<14}{schedule:<7}{policy:<12} predicted/allocator MiB per rank: {shown}")
    worst = max(abs(e) for row in rows for e in row["error"])
    print(f"largest |error| {worst:.1%}")
    record = {"num_microbatches": M, "global_batch": 16, "max_abs_error": worst, "rows": rows}
    write_record(args.out, {**record, "environment": env.finish()})


if __name__ == "__main__":
    main()
