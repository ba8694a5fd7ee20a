"""FSDP collectives on the collective stream: exposed time measured vs simulated, and collective time vs the ring.

Two parts, pp=1 x dp=2 on 2 processes pinned to distinct cores (gloo, one thread each):

1. **Collectives alone**: one all-gather and one reduce-scatter of buckets from 64 KiB to 32 MiB (each
   rank's part), ``--repeats`` each, idle cores. A ring link (latency, bandwidth) is fitted to the
   all-gathers by least squares; the table gives each size's median against the ring estimate.
2. **In the step**: the workload at standard size with its layers in one stage (1F1B, the stage's
   UNSHARD prefetched) and in ``--chunks`` stages on the rank (interleaved 1F1B: stage k+1's gather runs
   under stage k's compute, FSDP2's per-layer prefetch done by the plan). Per step (after the first) the
   exposed collective time, the collective stream's busy time under no compute
   (:func:`octopipe.simulate.exposed_collective_us`), measured from the runtime's timeline, against the
   simulator's for the same plan, fed the run's own median compute times per stage and kind and the
   fitted ring for the collectives (the whole model), and fed the collectives' own measured medians too
   (the collective stream's issue/wait model alone); and each measured UNSHARD / REDUCE_GRAD against its
   ring estimate.

    .venv/bin/python bench/fsdp_overlap.py [--workloads llama-8 moe-ep-4] [--steps 4] [--chunks 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quiet import add_arguments, start, write_record

from octopipe.execute.processes import free_port
from octopipe.execute.runs import RunOptions, RunResult
from octopipe.execute.runtime import build_model, measured_step_times_us, run_local, workload_reference
from octopipe.execute.runtime.measure import timelines_to_proto
from octopipe.ir import ActionKind, with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import CostModel, GroupLinks, Link, StageCost, exposed_collective_us, simulate
from octopipe.simulate.collectives import all_gather_us, reduce_scatter_us
from octopipe.simulate.costs import durations_from_timelines
from octopipe.tune import CollectivePlacement, equal_partition, interleaved_1f1b, one_f_one_b

OUT = Path(__file__).parent / "results" / "fsdp_overlap.json"
DP = 2
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
COMPUTE = (ActionKind.FORWARD, ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def _collectives_rank(rank: int, port: int, repeats: int, out: str) -> None:
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DP, timeout=datetime.timedelta(seconds=120)
    )
    times: dict[str, dict[int, list[float]]] = {"all_gather": {}, "reduce_scatter": {}}
    for size in SIZES:
        part = torch.ones(size // 4)
        whole = torch.empty(DP * part.numel())
        for _ in range(repeats + 1):  # the first is warm-up
            dist.barrier()
            started = time.perf_counter()
            dist.all_gather_into_tensor(whole, part)
            times["all_gather"].setdefault(size, []).append((time.perf_counter() - started) * 1e6)
            dist.barrier()
            started = time.perf_counter()
            dist.reduce_scatter_tensor(part, whole)
            times["reduce_scatter"].setdefault(size, []).append((time.perf_counter() - started) * 1e6)
    torch.save({"times": times, "cores": sorted(os.sched_getaffinity(0))}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def collectives_alone(repeats: int, scratch: Path) -> tuple[dict[str, Any], Link, dict[int, list[int]]]:
    mp.start_processes(_collectives_rank, args=(free_port(), repeats, str(scratch)), nprocs=DP, start_method="spawn")
    results = [torch.load(scratch / f"rank{r}.pt", weights_only=True) for r in range(DP)]
    medians: dict[str, dict[int, float]] = {}
    for kind in ("all_gather", "reduce_scatter"):
        medians[kind] = {
            size: statistics.median(max(r["times"][kind][size][i] for r in results) for i in range(1, repeats + 1))
            for size in SIZES
        }
    # ring over 2 ranks: t = latency + (1/2) * whole / bandwidth, whole = DP * part
    xs = [DP * s / 2 for s in SIZES]
    ys = [medians["all_gather"][s] for s in SIZES]
    slope, intercept = _least_squares(xs, ys)
    link = Link(latency_us=max(intercept, 0.0), bandwidth_bytes_per_second=1e6 / slope)
    rows = {
        kind: {
            str(size): {
                "measured_us": medians[kind][size],
                "ring_us": (all_gather_us if kind == "all_gather" else reduce_scatter_us)(link, DP, DP * size),
            }
            for size in SIZES
        }
        for kind in medians
    }
    return rows, link, {r: list(results[r]["cores"]) for r in range(DP)}


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def plans(workload: str, microbatches: int, chunks: int, tiny: bool) -> dict[str, plan_pb2.Plan]:
    reference = (
        workload_reference(workload, tiny=tiny, global_batch=DP * microbatches)
        if tiny
        else workload_reference(workload)
    )
    names = list(build_model(reference).model.pipeline_layers())  # type: ignore[operator]
    made = {
        "one stage": one_f_one_b(1, microbatches, layer_names=[names]),
        f"{chunks} stages": interleaved_1f1b(1, chunks, microbatches, layer_names=equal_partition(names, chunks)),
    }
    for plan in made.values():
        plan.model.CopyFrom(reference)
        plan.mesh.dp = DP
    return {name: with_collectives(plan, CollectivePlacement(prefetch=True)) for name, plan in made.items()}


def stage_bytes(plan: plan_pb2.Plan) -> list[int]:
    model = build_model(plan.model).model
    out = []
    for stage in plan.stages:
        out.append(
            sum(p.numel() * p.element_size() for n in stage.layer_names for p in model.get_submodule(n).parameters())
        )
    return out


def in_step(plan: plan_pb2.Plan, result: RunResult, link: Link) -> dict[str, Any]:
    """Measured vs simulated exposed collective time, and each collective against its ring estimate."""
    measured_exposed = [
        exposed_collective_us((r.stream, r.start_ns / 1e3, r.end_ns / 1e3) for r in steps[i].records)
        for steps in result.timelines.values()
        for i in range(1, len(steps))
    ]
    protos = [t for t in timelines_to_proto(result) if t.step > 0]
    measured = durations_from_timelines(protos)
    sizes = stage_bytes(plan)
    model = CostModel(
        stages=tuple(StageCost(parameter_bytes=b, gradient_bytes=b) for b in sizes),
        durations_us={key: value for key, value in measured.items() if key[1] in COMPUTE},
        collectives=GroupLinks(data_parallel=link),
    )
    simulation = simulate(plan, model)
    predicted = exposed_collective_us((t.stream, t.start_us, t.end_us) for t in simulation.timeline(0))
    # the stream model alone: the collectives' own measured medians instead of the ring
    replayed = simulate(plan, replace(model, durations_us=measured))
    replay = exposed_collective_us((t.stream, t.start_us, t.end_us) for t in replayed.timeline(0))
    exposed = statistics.median(measured_exposed)
    collectives = {
        f"{kind.name} stage {stage}": {
            "bytes": sizes[stage],
            "measured_us": measured[(stage, kind)],
            "ring_us": (all_gather_us if kind is ActionKind.UNSHARD else reduce_scatter_us)(link, DP, sizes[stage]),
        }
        for stage in range(len(sizes))
        for kind in (ActionKind.UNSHARD, ActionKind.REDUCE_GRAD)
        if (stage, kind) in measured
    }
    return {
        "step_ms": statistics.median(measured_step_times_us(result)[1:]) / 1e3,
        "predicted_step_ms": simulation.estimate.step_time_us / 1e3,
        "exposed_measured_ms": exposed / 1e3,
        "exposed_measured_p10_p90_ms": [
            sorted(measured_exposed)[len(measured_exposed) // 10] / 1e3,
            sorted(measured_exposed)[(len(measured_exposed) * 9) // 10] / 1e3,
        ],
        "exposed_predicted_ms": predicted / 1e3,
        "exposed_error": (predicted - exposed) / exposed if exposed else None,
        "exposed_replayed_ms": replay / 1e3,
        "exposed_replayed_error": (replay - exposed) / exposed if exposed else None,
        "collectives": collectives,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, rounds=1, steps=4)
    parser.add_argument("--workloads", nargs="+", default=["llama-8", "moe-ep-4"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    environment = start(parser, args)
    record: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    scratch = Path(f"/tmp/octopipe-collectives-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    alone, link, cores = collectives_alone(args.repeats, scratch)
    environment.record(cores)
    record["collectives_alone"] = alone
    record["fitted_link"] = {"latency_us": link.latency_us, "bandwidth_gb_s": link.bandwidth_bytes_per_second / 1e9}
    print(
        f"ring fitted to the all-gathers: latency {link.latency_us:.0f} us, {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    for kind, rows in alone.items():
        for size, row in rows.items():
            error = row["ring_us"] / row["measured_us"] - 1
            print(
                f"  {kind:>14} {int(size) >> 10:>6} KiB/rank: {row['measured_us']:8.0f} us, ring {row['ring_us']:8.0f} us ({error:+.0%})"
            )
    record["in_step"] = {}
    for workload, name, plan in [
        (w, n, p) for w in args.workloads for n, p in plans(w, args.microbatches, args.chunks, args.tiny).items()
    ]:
        samples = []
        for _ in range(args.rounds):
            result = run_local(plan, RunOptions(steps=args.steps, timeout_s=600))
            environment.record(result.cores)
            samples.append(in_step(plan, result, link))
        figures = min(samples, key=lambda s: s["step_ms"]) if len(samples) > 1 else samples[0]
        record["in_step"][f"{workload} {name}"] = {"plan": plan.name, **figures, "rounds": samples}
        error = figures["exposed_error"]
        print(
            f"{workload} {name}: step {figures['step_ms']:.0f} ms (simulated {figures['predicted_step_ms']:.0f}); "
            f"exposed collectives {figures['exposed_measured_ms']:.1f} ms measured, "
            f"{figures['exposed_predicted_ms']:.1f} ms simulated" + (f" ({error:+.0%})" if error is not None else "")
        )
        print(
            f"  replayed with the collectives' measured times: {figures['exposed_replayed_ms']:.1f} ms "
            f"({figures['exposed_replayed_error']:+.0%})"
        )
        for label, row in figures["collectives"].items():
            print(
                f"  {label}: {row['bytes'] / 2**20:.1f} MiB, {row['measured_us'] / 1e3:.1f} ms measured, ring {row['ring_us'] / 1e3:.1f} ms"
            )
    record["environment"] = environment.finish()
    write_record(OUT, record)


if __name__ == "__main__":
    main()
