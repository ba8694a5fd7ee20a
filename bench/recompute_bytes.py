"""Bytes each stage's forward keeps for its backward, under each recomputation policy (``CaptureConfig.recompute``).

For each standard workload (standard sizes, micro-batch 2 x 128 tokens, the
2-stage equal partition) it captures both stages with ``none``, ``layers``,
``budget:0.5`` and ``budget:0``, checks that the loss and every gradient are
bitwise those of ``none`` (F for both stages, then B, then W), and prints the
saved bytes from the graphs' metadata (parameters the backward reads included).
These are sizes, not times: they do not depend on the machine's load.

    .venv/bin/python bench/recompute_bytes.py [--workloads llama-8 ...] [--out bench/results/recompute_bytes.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, require_quiet, write_record

from octopipe.capture import CaptureConfig, pipeline_spec
from octopipe.examples.workloads import WORKLOADS, workload
from tests.pipeline_reference import Result, run_split

POLICIES = {
    "none": CaptureConfig(),
    "layers": CaptureConfig(recompute="layers"),
    "budget:0.5": CaptureConfig(recompute="budget", activation_budget=0.5),
    "budget:0": CaptureConfig(recompute="budget", activation_budget=0.0),
}


def saved(result: Result) -> list[int]:
    out = []
    for exe in result.stages:
        outputs = next(n for n in reversed(exe.graphs.forward.graph.nodes) if n.op == "output").args[0]
        out.append(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in outputs[exe.graphs.num_outputs :]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("bench/results/recompute_bytes.json"))
    args = parser.parse_args()
    require_quiet()
    env = Environment()
    rows = []
    print(f"{'workload':<14}{'policy':<12}{'stage 0 MiB':>12}{'stage 1 MiB':>12}{'of none':>9}  bitwise")
    for name in args.workloads:
        spec = workload(name)
        model = spec.model()
        tokens, targets = (t[:2] for t in spec.batch())
        names = pipeline_spec(model).names
        partition = [names[: len(names) // 2], names[len(names) // 2 :]]
        base: Result | None = None
        for label, config in POLICIES.items():
            result = run_split(model, partition, tokens, targets, seed=0, config=config)
            base = base or result
            bitwise = torch.equal(result.loss, base.loss) and sorted(result.grads) == sorted(base.grads)
            bitwise = bitwise and all(torch.equal(result.grads[k], v) for k, v in base.grads.items())
            kept, full = saved(result), saved(base)
            fraction = sum(kept) / sum(full)
            rows.append(
                {"workload": name, "policy": label, "saved_bytes": kept, "of_none": fraction, "bitwise": bitwise}
            )
            mib = [b / 2**20 for b in kept]
            print(f"{name:<14}{label:<12}{mib[0]:>12.1f}{mib[1]:>12.1f}{fraction:>9.2f}  {bitwise}")
    write_record(args.out, {"microbatch": [2, 128], "stages": 2, "rows": rows, "environment": env.finish()})


if __name__ == "__main__":
    main()
