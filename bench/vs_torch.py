"""octopipe vs torch.distributed.pipelining: the same model, micro-batches and schedule order, step time.

For each torch schedule class, torch computes its own order; octopipe runs that
order imported as a Plan (``octopipe.execute.runtime.interop.torch_schedule_plan``) with
captured, split stages, while torch runs it with its PipelineStage runtime on
the same stage modules. Both: 2 gloo ranks on 127.0.0.1, one pinned core and
one thread each, a barrier before every step, the optimizer outside the timed
region. Launches alternate (torch, octopipe, torch, octopipe, ...); the table
gives the median step time over the timed steps of all rounds (the first step of
each launch is warm-up) and the 10th-90th percentile range.

    .venv/bin/python bench/vs_torch.py [--workload llama-8] [--rounds 2] [--steps 4] [--compile inductor]

With ``--compile inductor`` octopipe's stage graphs are compiled (``RunOptions(compile="inductor")``;
issue 20's comparison: compiled octopipe vs torch's eager runtime), written to ``vs_torch_compiled.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quiet import Environment, percentile, require_quiet
from torch.distributed.pipelining import PipelineStage, schedules

from octopipe.capture import StageModule, pipeline_spec
from octopipe.execute.processes import free_port
from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local, workload_reference
from octopipe.execute.runtime.interop import torch_placement, torch_schedule_plan
from octopipe.execute.runtime.models import build_model
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b

SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]


def _torch_worker(rank: int, port: int, name: str, reference: bytes, m: int, steps: int, out: str) -> None:
    cores, _ = pin_rank(rank)  # the machine's online CPUs, never the mask this process inherited
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    built = build_model(plan_pb2.ModelReference.FromString(reference))
    model = built.model
    spec = pipeline_spec(model)
    placement = torch_placement(name, 2)
    parts = equal_partition(spec.names, len(placement))
    by_name = {layer.name: layer for layer in spec.layers}
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = [
        PipelineStage(
            StageModule(model, [by_name[n] for n in parts[s]], stage_index=s, num_stages=len(placement), loss=None),
            s,
            len(placement),
            torch.device("cpu"),
        )
        for s in mine
    ]
    cls: Any = getattr(schedules, name)
    loss = model.pipeline_loss
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    schedule = cls(stages if multi else stages[0], m, loss_fn=loss)
    optimizer = torch.optim.AdamW([p for st in stages for p in st.submod.parameters()], lr=1e-3, foreach=False)
    times = []
    holds_first, holds_last = 0 in mine, len(placement) - 1 in mine
    for step in range(steps):
        tokens, targets = built.batch(step)
        dist.barrier()
        start = time.perf_counter_ns()
        args = (tokens,) if holds_first else ()
        schedule.step(*args, target=targets if holds_last else None)
        times.append((time.perf_counter_ns() - start) / 1e3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "cores": cores}))
    dist.destroy_process_group()


def run_torch(name: str, reference: Any, m: int, steps: int) -> tuple[list[float], dict[int, list[int]]]:
    """torch's ``name`` schedule: each step's time (slowest rank), and the cores each rank ran on."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _torch_worker,
            args=(free_port(), name, reference.SerializeToString(), m, steps, folder),
            nprocs=2,
            start_method="spawn",
        )
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    times = [max(values) for values in zip(*(r["times"] for r in per_rank), strict=True)]
    return times, {r: per_rank[r]["cores"] for r in range(2)}


def run_octopipe(
    name: str, reference: Any, m: int, steps: int, compile_: str = "eager"
) -> tuple[list[float], dict[int, list[int]]]:
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    parts = equal_partition(names, len(torch_placement(name, 2)))
    if name == "Schedule1F1B":  # torch 2.13's 1F1B order is off by one on the last rank (it runs fine): use ours
        plan = one_f_one_b(2, m, layer_names=parts)
        plan.model.CopyFrom(reference)
    else:
        plan = torch_schedule_plan(name, num_ranks=2, num_microbatches=m, layer_names=parts, model=reference)
    result = run_local(plan, RunOptions(steps=steps, timeout_s=900, compile=compile_))
    return measured_step_times_us(result), {int(r): list(c) for r, c in result.cores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="llama-8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per launch; the first is warm-up")
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--tiny", action="store_true", help="unit-test sizes (a smoke run)")
    parser.add_argument("--compile", choices=["eager", "inductor"], default="eager", help="octopipe's stage graphs")
    parser.add_argument("--out", type=Path, help="default: results/vs_torch.json (vs_torch_compiled.json compiled)")
    args = parser.parse_args()
    name_ = "vs_torch_compiled.json" if args.compile == "inductor" else "vs_torch.json"
    args.out = args.out or Path(__file__).parent / "results" / name_
    load_before = require_quiet()
    environment = Environment()  # each launch's rank cores, checked distinct
    config = {"tiny": True, "sequence": 16} if args.tiny else {}
    reference = workload_reference(args.workload, **config)
    m = 8
    rows = []
    for name in args.schedules:
        measured: dict[str, list[float]] = {"torch": [], "octopipe": []}
        for _ in range(args.rounds):
            times, cores = run_torch(name, reference, m, args.steps)
            measured["torch"] += times[1:]
            environment.record(cores)
            times, cores = run_octopipe(name, reference, m, args.steps, args.compile)
            measured["octopipe"] += times[1:]
            environment.record(cores)
        row: dict[str, Any] = {"schedule": name}
        for key, values in measured.items():
            row[key] = {"median_ms": statistics.median(values) / 1e3, "p10_ms": percentile(values, 0.1) / 1e3,
                        "p90_ms": percentile(values, 0.9) / 1e3, "samples": len(values)}  # fmt: skip
        row["ratio"] = row["octopipe"]["median_ms"] / row["torch"]["median_ms"]
        rows.append(row)
        print(
            f"{name}: torch {row['torch']['median_ms']:.0f} ms, octopipe {row['octopipe']['median_ms']:.0f} ms, ratio {row['ratio']:.3f}",
            flush=True,
        )
    print(
        f"\noctopipe vs torch.distributed.pipelining, {args.workload}{' (tiny)' if args.tiny else ''}, 2 ranks, m={m}"
    )
    print(f"{'schedule':<30} {'torch ms [p10, p90]':>26} {'octopipe ms [p10, p90]':>26} {'ratio':>7}")
    for r in rows:
        t, o = r["torch"], r["octopipe"]
        print(
            f"{r['schedule']:<30} {t['median_ms']:>8.0f} [{t['p10_ms']:>6.0f}, {t['p90_ms']:>6.0f}]"
            f" {o['median_ms']:>11.0f} [{o['p10_ms']:>6.0f}, {o['p90_ms']:>6.0f}] {r['ratio']:>7.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"workload": args.workload, "m": m, "compile": args.compile, "rows": rows}
    record["load_average_before"], record["load_average_after"] = list(load_before), list(os.getloadavg())
    record["rank_cores_per_run"] = environment.runs
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
