"""What checkpoints cost a training step: none vs synchronous vs asynchronous, every step.

llama-8 at the standard sizes (shared/benchmarks.md), 2 local gloo ranks (one
pinned core each, checked), 1F1B with equal layer counts, m = 8. Each round
launches the three variants one after the other (none, sync, async: interleaved
over ``--rounds``), ``--steps`` steps each, a checkpoint after every step
(``checkpoint_keep`` 2 for both checkpointing variants, so the disk holds at
most three: the same deletion work in both). The figure is the **step period**:
from the latest rank's start of step k to its start of step k + 1, which holds
everything a step costs, the optimizer update and the checkpoint save included
(the timelines' own step times end before both). The first period of a launch
(step 0 to 1: warm-up, and the first save) is left out, and the last step has
no next start. Overhead = median period / the no-checkpoint median - 1; the
goal for asynchronous saves is at most 5 %.

Checkpoints go to ``--checkpoint-dir`` (default: a temporary folder; its
filesystem is recorded) and are deleted after each launch. ``--quick`` is a
smoke run at tiny sizes (1 round, 4 steps): it checks the script, it is not a
result. Refuses a busy machine unless ``--force``.

    .venv/bin/python bench/checkpoint_overhead.py [--rounds 5] [--steps 12]
    .venv/bin/python bench/checkpoint_overhead.py --quick --force --out /tmp/checkpoint_overhead.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from quiet import Environment, add_arguments, start, step_summary, write_record

from octopipe.execute.checkpoint_files import checkpoint_path, latest_checkpoint
from octopipe.execute.runtime import RunOptions, RunResult, build_model, run_local, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b

M, P = 8, 2
VARIANTS = ("none", "sync", "async")
KEEP = 2


def make_plan(tiny: bool) -> plan_pb2.Plan:
    reference = (
        workload_reference("llama-8", tiny=True, sequence=16, global_batch=2 * M)
        if tiny
        else workload_reference("llama-8")
    )
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(P, M, layer_names=equal_partition(names, P))
    plan.model.CopyFrom(reference)
    return plan


def step_periods_us(run: RunResult) -> list[float]:
    """Start of step k + 1 minus start of step k (the latest rank's starts), k = 1 .. steps - 2, in microseconds."""
    count = min(len(steps) for steps in run.timelines.values())
    starts = [max(steps[i].start_ns for steps in run.timelines.values()) for i in range(count)]
    return [(starts[i + 1] - starts[i]) / 1e3 for i in range(1, count - 1)]


def options(variant: str, steps: int, folder: Path) -> RunOptions:
    if variant == "none":
        return RunOptions(steps=steps, timeout_s=600.0)
    return RunOptions(
        steps=steps,
        timeout_s=600.0,
        checkpoint_dir=str(folder),
        checkpoint_every=1,
        checkpoint_async=variant == "async",
        checkpoint_keep=KEEP,
    )


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def filesystem(folder: Path) -> str:
    """The filesystem type holding ``folder`` (``df --output=fstype``; '' where df cannot say)."""
    try:
        answer = subprocess.run(
            ["df", "--output=fstype", str(folder)], capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = answer.stdout.split()
    return lines[-1] if len(lines) > 1 else ""


def measure(args: argparse.Namespace, env: Environment, root: Path) -> dict[str, Any]:
    plan = make_plan(args.tiny)
    periods: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    checkpoint_bytes = 0
    for round_index in range(args.rounds):
        for variant in VARIANTS:
            folder = root / f"{variant}-{round_index}"
            run = run_local(plan, options(variant, args.steps, folder))
            env.record(run.cores)
            periods[variant] += step_periods_us(run)
            if variant != "none":
                assert latest_checkpoint(folder) == args.steps, f"{variant}: the last checkpoint was not committed"
                checkpoint_bytes = folder_bytes(checkpoint_path(folder, args.steps))
            shutil.rmtree(folder, ignore_errors=True)
            print(
                f"round {round_index + 1}/{args.rounds} {variant}: {statistics.median(periods[variant]) / 1e3:.1f} ms"
            )
    baseline = statistics.median(periods["none"])
    rows = {}
    for variant in VARIANTS:
        rows[variant] = {
            "step_period": step_summary(periods[variant]),
            "overhead_pct": 100.0 * (statistics.median(periods[variant]) / baseline - 1.0),
        }
    return {"rows": rows, "checkpoint_bytes": checkpoint_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, rounds=5, steps=12)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: --tiny, 1 round, 4 steps (default: off; not a result)"
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="where the checkpoints go (default: a temporary folder)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "checkpoint_overhead.json",
        help="the JSON record (default: bench/results/checkpoint_overhead.json)",
    )
    args = parser.parse_args()
    if args.quick:
        args.tiny, args.rounds, args.steps = True, 1, 4
    if args.steps < 4:
        parser.error("give --steps >= 4: the first period is warm-up and the last step has no next start")
    env = start(parser, args)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="octopipe-ckpt-bench-", dir=args.checkpoint_dir) as scratch:
        root = Path(scratch)
        result = measure(args, env, root)
        fstype = filesystem(root)
    size = "tiny sizes (smoke run, not a result)" if args.tiny else "standard sizes"
    print(
        f"\ncheckpoint overhead, llama-8 {size}, {P} ranks, 1F1B m={M}, a checkpoint every step "
        f"({result['checkpoint_bytes'] / 2**20:.1f} MiB each, on {fstype or 'an unknown filesystem'})"
    )
    print(f"{'variant':<8}{'step period ms':>16}{'p10':>9}{'p90':>9}{'samples':>9}{'overhead':>10}")
    for variant, row in result["rows"].items():
        s = row["step_period"]
        print(
            f"{variant:<8}{s['median_ms']:>16.1f}{s['p10_ms']:>9.1f}{s['p90_ms']:>9.1f}{s['samples']:>9}"
            f"{row['overhead_pct']:>9.1f}%"
        )
    record = {
        "environment": env.finish(),
        "workload": "llama-8",
        "sizes": "tiny" if args.tiny else "standard",
        "plan": f"1f1b p={P} m={M}, equal layers",
        "rounds": args.rounds,
        "steps": args.steps,
        "checkpoint_every": 1,
        "checkpoint_keep": KEEP,
        "checkpoint_filesystem": fstype,
        "checkpoint_bytes": result["checkpoint_bytes"],
        "variants": result["rows"],
        "goal": "async overhead <= 5% of the no-checkpoint step",
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
