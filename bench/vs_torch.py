"""octopipe vs torch.distributed.pipelining on the same schedule order: the runtime's own cost, every workload.

For each workload and each torch schedule class, torch computes its order and
runs it with its own runtime (``torch_pp.run_torch``); octopipe runs the same
order, imported as a Plan (``runtime.interop.torch_schedule_plan``; for 1F1B
octopipe's own, because torch 2.13 numbers the last rank's 1F1B forwards from 1),
with captured, split stages. Same model, weights, micro-batches (m = 8), loss and
AdamW; 2 gloo ranks on 127.0.0.1, each pinned to its own core, one thread, the
same host allocator policy on both sides (``--torch-host-memory system`` gives
torch the C library's defaults instead: torch as a user starts it). Every
candidate runs in every round, interleaved (``interleave.run_rounds``); the
first ``--warmup`` steps of each launch (default 1) are warm-up, for every candidate alike. Reported per schedule: median step
[p10, p90] of each side over all rounds, and the ratio octopipe / torch (below
1: octopipe faster) with a two-level bootstrap 90% interval.

``--compile inductor``: octopipe's stage graphs compiled by Inductor, torch's
layer modules compiled in place (``module.compile()``, as torchtitan does); a
torch schedule that cannot run compiled blocks is recorded as failed with its
error's first line, and its ratio is not taken. Written to
``results/vs_torch_compiled.json`` (eager: ``results/vs_torch.json``).

The JSON is merged per workload: a run replaces the workloads it measured and
keeps the others, each with its own environment, rounds and commit
(``bench/headline.py`` writes its same-order candidates here too: the same
interleaved launches, beside the tuned plan).

    .venv/bin/python bench/vs_torch.py [--workloads llama-8 jamba-8 nemotronh-16 moe-ep-4] [--rounds 5]
        [--steps 3] [--warmup 1] [--schedules ...] [--compile inductor] [--torch-host-memory system]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from interleave import Candidate, Measured, ratio_interval, run_rounds, summary
from quiet import Environment, add_arguments, start
from torch_pp import SCHEDULES, run_torch

from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local, workload_reference
from octopipe.execute.runtime.interop import torch_placement, torch_schedule_plan
from octopipe.execute.runtime.models import build_model
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b

WORKLOADS = ["llama-8", "jamba-8", "nemotronh-16", "moe-ep-4"]
M = 8


def same_order_plan(name: str, reference: plan_pb2.ModelReference) -> plan_pb2.Plan:
    """torch's ``name`` order as an octopipe Plan with equal layer counts (1F1B: octopipe's own order)."""
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    parts = equal_partition(names, len(torch_placement(name, 2)))
    if name == "Schedule1F1B":  # torch 2.13's 1F1B order is off by one on the last rank (it runs fine): use ours
        plan = one_f_one_b(2, M, layer_names=parts)
        plan.model.CopyFrom(reference)
        return plan
    return torch_schedule_plan(name, num_ranks=2, num_microbatches=M, layer_names=parts, model=reference)


def octopipe_candidate(
    label: str, plan: plan_pb2.Plan, args: argparse.Namespace, env: Environment, compile_: str
) -> Candidate:
    def run() -> list[float]:
        result = run_local(plan, RunOptions(steps=args.steps, timeout_s=900, compile=compile_))
        env.record(result.cores)
        env.host_memory.append({"candidate": label, **{str(r): m for r, m in result.host_memory.items()}})
        return measured_step_times_us(result)[args.warmup :]

    return Candidate(label, run)


def torch_candidate(
    label: str, name: str, reference: plan_pb2.ModelReference, args: argparse.Namespace, env: Environment
) -> Candidate:
    def run() -> list[float]:
        times, cores = run_torch(
            name,
            reference,
            M,
            args.steps,
            compile_blocks=args.compile == "inductor",
            host_memory=args.torch_host_memory,
        )
        env.record(cores)
        return times[args.warmup :]

    return Candidate(label, run)


def same_order_rows(measured: dict[str, Measured], schedules: list[str]) -> list[dict[str, Any]]:
    """Per schedule: each side's summary and octopipe / torch with its bootstrap 90% interval."""
    rows = []
    for name in schedules:
        theirs, ours = measured[f"torch {name}"], measured[f"octopipe {name}"]
        row: dict[str, Any] = {"schedule": name, "torch": summary(theirs), "octopipe": summary(ours)}
        if theirs.error:
            row["torch_failed"] = theirs.error
        if theirs.launches and ours.launches:
            row["ratio"] = ours.median_us / theirs.median_us
            row["ratio_ci90"] = list(ratio_interval(ours, theirs))
        rows.append(row)
    return rows


def bench_workload(workload: str, args: argparse.Namespace, env: Environment) -> list[dict[str, Any]]:
    reference = workload_reference(workload, tiny=True, sequence=16) if args.tiny else workload_reference(workload)
    compile_ = "inductor" if args.compile == "inductor" else "eager"
    candidates = []
    for name in args.schedules:
        candidates.append(torch_candidate(f"torch {name}", name, reference, args, env))
        candidates.append(octopipe_candidate(f"octopipe {name}", same_order_plan(name, reference), args, env, compile_))
    print(f"\n{workload}: {len(candidates)} candidates x {args.rounds} rounds", flush=True)
    measured = {m.name: m for m in run_rounds(candidates, args.rounds)}
    return same_order_rows(measured, args.schedules)


def commit() -> str:
    """The short commit the benchmark ran (empty outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def merge_workloads(
    path: Path, rows: dict[str, list[dict[str, Any]]], run: dict[str, Any], *, compile_: str, tiny: bool
) -> None:
    """Write each workload's rows with ``run`` (environment, rounds, source) into ``path``, keeping the others.

    A file from a different mode (compile, tiny) is replaced, not merged: its rows would not compare.
    """
    record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if record.get("compile") != compile_ or record.get("tiny") != tiny or "runs" not in record:
        record = {"m": M, "compile": compile_, "tiny": tiny, "octopipe_host_memory": "reuse", "workloads": {}}
    for workload, workload_rows in rows.items():
        record["workloads"][workload] = {"rows": workload_rows, "run": run}
    ratios = [r["ratio"] for w in record["workloads"].values() for r in w["rows"] if "ratio" in r]
    record["max_ratio"] = max(ratios) if ratios else None
    record["median_ratio"] = statistics.median(ratios) if ratios else None
    record["runs"] = "each workload's own: workloads.<name>.run"
    environment = run["environment"]
    print(f"load average before {environment['load_average_before']}, after {environment['load_average_after']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {path} ({', '.join(rows)} updated)")


def run_record(env: Environment, args: argparse.Namespace, source: str, **extra: Any) -> dict[str, Any]:
    """What one benchmark run was: the machine, rounds, steps, commit, date and the script."""
    return {
        "source": source,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "rounds": args.rounds,
        "steps_per_launch": args.steps,
        "warmup_steps": args.warmup,
        **extra,
        "environment": env.finish(),
    }


def print_table(workload: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{workload}: octopipe / torch on the same order, 2 ranks, m={M}")
    print(f"{'schedule':<26} {'torch ms [p10, p90]':>24} {'octopipe ms [p10, p90]':>24} {'ratio [90% CI]':>22}")
    for r in rows:

        def cell(s: dict[str, Any]) -> str:
            return (
                f"{s['median_ms']:>8.0f} [{s['p10_ms']:>6.0f}, {s['p90_ms']:>6.0f}]" if s.get("samples") else "failed"
            )

        ratio = f"{r['ratio']:.3f} [{r['ratio_ci90'][0]:.3f}, {r['ratio_ci90'][1]:.3f}]" if "ratio" in r else "-"
        print(f"{r['schedule']:<26} {cell(r['torch']):>24} {cell(r['octopipe']):>24} {ratio:>22}")
        if "torch_failed" in r:
            print(f"{'':<26} torch failed: {r['torch_failed']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--compile", choices=["eager", "inductor"], default="eager")
    parser.add_argument(
        "--torch-host-memory",
        choices=["reuse", "system"],
        default="reuse",
        help="torch's ranks' C allocator: octopipe's policy (default, like for like) or the C library's defaults",
    )
    parser.add_argument("--out", type=Path, help="default: results/vs_torch.json (vs_torch_compiled.json compiled)")
    add_arguments(parser, rounds=5, steps=3, warmup=True)
    args = parser.parse_args()
    name = "vs_torch_compiled.json" if args.compile == "inductor" else "vs_torch.json"
    args.out = args.out or Path(__file__).parent / "results" / name
    env = start(parser, args)
    workloads = {w: bench_workload(w, args, env) for w in args.workloads}
    for w, rows in workloads.items():
        print_table(w, rows)
    run = run_record(env, args, "bench/vs_torch.py", torch_host_memory=args.torch_host_memory)
    merge_workloads(args.out, workloads, run, compile_=args.compile, tiny=args.tiny)


if __name__ == "__main__":
    main()
