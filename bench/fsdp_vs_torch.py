"""Data parallelism, pp=1 x dp=2: octopipe's FSDP (the plan's UNSHARD / REDUCE_GRAD actions) against torch's
FSDP2 (``fully_shard`` on every pipeline layer and the root, its default prefetching) on the same model,
global batch and micro-batches. The FSDP-overlap issue's (19) figure; its baseline, taken before its work
(one collective per parameter, blocking), is in ``results/fsdp_vs_torch_before.json``.

Both sides: 2 processes on 2 distinct cores (checked), gloo on 127.0.0.1, one thread each, AdamW, the
workload's standard sizes (shared/benchmarks.md), ``--microbatches`` micro-batches per replica with the
gradients reduced once per step (FSDP2: ``set_requires_gradient_sync(False)`` on all but the last
micro-batch's backward, as octopipe's REDUCE_GRAD after the last backward). octopipe runs 1F1B on one
pipeline rank per replica with ``with_collectives``' default placement (the stage's UNSHARD prefetched at
the start, REDUCE_GRAD after its last backward; one bucketed all-gather and reduce-scatter each, on the
rank's collective stream): it holds the whole unsharded model through the step, so FSDP2 also runs with
``reshard_after_forward=False`` ("fsdp2-keep", the same memory policy) beside its default (reshard after
forward, gather again for backward). "octopipe-chunks" puts the layers in ``--chunks`` stages on the rank
(interleaved 1F1B, every UNSHARD prefetched): stage k+1's gather and stage k's reduce-scatter run under the
other stages' compute, as FSDP2's per-layer prefetch. Interleaved rounds; the first step of each launch is
warm-up; medians and p10-p90 of the other steps. A step is timed as octopipe times its steps: from the
ranks' common start to the gradients reduced on every rank (the optimizer step is outside, on both sides).

    .venv/bin/python bench/fsdp_vs_torch.py [--workloads llama-8 moe-ep-4] [--rounds 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quiet import add_arguments, start, step_summary, write_record
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from octopipe.execute.processes import free_port
from octopipe.execute.runs import RunOptions
from octopipe.execute.runtime import build_model, measured_step_times_us, run_local, workload_reference
from octopipe.execute.runtime.mesh import replica_batch
from octopipe.ir import with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, interleaved_1f1b, one_f_one_b

OUT = Path(__file__).parent / "results" / "fsdp_vs_torch.json"
DP = 2


def octopipe_plan(workload: str, microbatches: int, chunks: int = 1) -> plan_pb2.Plan:
    reference = workload_reference(workload)
    names = list(build_model(reference).model.pipeline_layers())  # type: ignore[operator]
    if chunks == 1:
        plan = one_f_one_b(1, microbatches, layer_names=[names])
    else:
        plan = interleaved_1f1b(1, chunks, microbatches, layer_names=equal_partition(names, chunks))
    plan.model.CopyFrom(reference)
    plan.mesh.dp = DP
    return with_collectives(plan)


def _fsdp2_rank(rank: int, workload: str, microbatches: int, steps: int, port: int, out: str, reshard: bool) -> None:
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DP, timeout=datetime.timedelta(seconds=300)
    )
    built = build_model(workload_reference(workload), seed=0)
    model = built.model
    mesh = init_device_mesh("cpu", (DP,))
    for name in model.pipeline_layers():  # type: ignore[operator]
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
    root = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        tokens, targets = replica_batch(*built.batch(step), dp=DP, replica=rank, num_microbatches=microbatches)
        dist.barrier()
        started = time.perf_counter()
        for index, (x, y) in enumerate(zip(tokens.chunk(microbatches), targets.chunk(microbatches), strict=True)):
            root.set_requires_gradient_sync(index == microbatches - 1)  # reduce once, after the last backward
            (model(x, y) / microbatches).backward()
        dist.barrier()
        times.append(time.perf_counter() - started)  # as octopipe's measured step: to the reduced gradients
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save({"times_s": times, "cores": sorted(os.sched_getaffinity(0))}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def fsdp2(
    workload: str, microbatches: int, steps: int, scratch: Path, reshard: bool
) -> tuple[list[float], dict[int, list[int]]]:
    """Per step (after the first): the slower rank's time, in microseconds; and each rank's cores."""
    arguments = (workload, microbatches, steps, free_port(), str(scratch), reshard)
    mp.start_processes(_fsdp2_rank, args=arguments, nprocs=DP, start_method="spawn")
    results = [torch.load(scratch / f"rank{r}.pt", weights_only=True) for r in range(DP)]
    times = [max(r["times_s"][s] for r in results) * 1e6 for s in range(1, steps)]
    return times, {r: list(results[r]["cores"]) for r in range(DP)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, rounds=3, steps=4)
    parser.add_argument("--workloads", nargs="+", default=["llama-8", "moe-ep-4"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4, help="stages on the rank in the octopipe-chunks arm")
    args = parser.parse_args()
    environment = start(parser, args)
    record: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "workloads": {}}
    for workload in args.workloads:
        plans = {
            "octopipe": octopipe_plan(workload, args.microbatches),
            "octopipe-chunks": octopipe_plan(workload, args.microbatches, args.chunks),
        }
        arms = ("octopipe", "octopipe-chunks", "fsdp2", "fsdp2-keep")
        samples: dict[str, list[float]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            for arm in arms if round_ % 2 == 0 else arms[::-1]:
                if arm in plans:
                    result = run_local(plans[arm], RunOptions(steps=args.steps, timeout_s=300))
                    samples[arm] += measured_step_times_us(result)[1:]
                    environment.record(result.cores)
                else:
                    scratch = Path(f"/tmp/octopipe-fsdp2-{os.getpid()}-{round_}")
                    scratch.mkdir(parents=True, exist_ok=True)
                    times, cores = fsdp2(workload, args.microbatches, args.steps, scratch, reshard=arm == "fsdp2")
                    samples[arm] += times
                    environment.record(cores)
        figures = {arm: step_summary(samples[arm]) for arm in arms}
        theirs, keep = figures["fsdp2"], figures["fsdp2-keep"]
        entry: dict[str, Any] = {**figures, "plans": {arm: plan.name for arm, plan in plans.items()}}
        for arm in plans:
            ours = figures[arm]
            entry[f"{arm} ratio"] = ours["median_ms"] / theirs["median_ms"]
            entry[f"{arm} ratio_keep"] = ours["median_ms"] / keep["median_ms"]
            print(
                f"{workload:>10} {arm:>15}: {ours['median_ms']:.0f} ms [{ours['p10_ms']:.0f}, {ours['p90_ms']:.0f}], "
                f"FSDP2 {theirs['median_ms']:.0f} ms [{theirs['p10_ms']:.0f}, {theirs['p90_ms']:.0f}] "
                f"(unsharded after forward kept: {keep['median_ms']:.0f} ms): {entry[f'{arm} ratio']:.2f}x FSDP2's "
                f"default step (goal <= 1.0x), {entry[f'{arm} ratio_keep']:.2f}x the kept one"
            )
        record["workloads"][workload] = entry
    record["environment"] = environment.finish()
    write_record(OUT, record)


if __name__ == "__main__":
    main()
