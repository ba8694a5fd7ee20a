"""Profiler repeatability: the spread of each layer's F, B and W times over several whole profiles.

Profiles a standard workload (shared/benchmarks.md) ``--runs`` times in one
process, one thread pinned to one core, and reports per layer the median time
and the relative spread (max - min) / median of F, B and W across the runs.

    .venv/bin/python bench/profiler_repeatability.py [--workload jamba-8] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from octopipe.examples import workload
from octopipe.transform import ProfilerConfig, profile_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="jamba-8")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats inside each profile (median)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "profiler_repeatability.json")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    chosen = workload(args.workload)
    model = chosen.model(seed=0)
    tokens, targets = chosen.batch(seed=0)
    size = chosen.microbatch_size
    profiles = [
        profile_layers(model, tokens[:size], targets[:size], config=ProfilerConfig(repeats=args.repeats))
        for _ in range(args.runs)
    ]
    rows = []
    for index, first in enumerate(profiles[0].layers):
        row: dict[str, object] = {"layer": first.layer_name, "type": first.layer_type}
        for key, field in (
            ("F", "forward_duration_us"),
            ("B", "backward_input_duration_us"),
            ("W", "backward_weight_duration_us"),
        ):
            values = [getattr(p.layers[index], field) / 1e3 for p in profiles]
            median = statistics.median(values)
            row[f"{key}_ms"] = median
            row[f"{key}_spread"] = (max(values) - min(values)) / median if median else 0.0
        rows.append(row)
    print(
        f"profiler repeatability, {args.workload}, micro-batch {size} x {chosen.sequence}, {args.runs} profiles, each the median of {args.repeats} runs"
    )
    print(f"{'layer':<10} {'type':<18} {'F ms':>8} {'spread':>7} {'B ms':>8} {'spread':>7} {'W ms':>8} {'spread':>7}")
    for r in rows:
        print(
            f"{r['layer']:<10} {r['type']:<18} {r['F_ms']:>8.2f} {r['F_spread']:>7.1%} {r['B_ms']:>8.2f} {r['B_spread']:>7.1%} "
            f"{r['W_ms']:>8.2f} {r['W_spread']:>7.1%}"
        )
    spreads = [float(str(r[f"{k}_spread"])) for r in rows for k in "FBW"]
    print(f"median spread {statistics.median(spreads):.1%}, worst {max(spreads):.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": args.workload, "runs": args.runs, "rows": rows}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
