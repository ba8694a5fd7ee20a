"""The local launcher: start one process per rank for a Plan, watch them, collect results.

Ranks rendezvous through a TCPStore this process hosts on 127.0.0.1. If a rank
fails, the store's abort flag stops the others at their next wait; any rank
still alive after a grace period is killed. The error names the first failing
rank, its step and its action.

Every plan is verified before any process starts (``octopipe.simulate.verify_plan``:
the program compiler's checks and the deadlock check, the same as the
coordinator, the node daemon and ``octopipe run --torchrun`` run), so a plan the
verifier rejects never runs. A plan with a mesh (``mesh.dp`` replicas of every
pipeline rank) starts pp x dp processes.
The reported loss is the mean of the replicas' losses; gradients and weights
are whole tensors (gathered from the shards by the ranks); timelines are keyed
by global rank.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from octopipe.execute.devices import gpu_problem
from octopipe.execute.processes import free_port
from octopipe.execute.runs import (
    ABORT_KEY,
    RunFailed,
    RunOptions,
    RunResult,
    StepTimeline,
    WorkerConfig,
    optimization_problem,
    precision_problem,
    weights_problem,
)
from octopipe.execute.runtime.emulate import emulation_problem
from octopipe.execute.runtime.pinning import shared_cores
from octopipe.execute.runtime.tensor_parallel import split_problem
from octopipe.execute.runtime.worker import worker_main
from octopipe.ir import MeshSpec, mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import verify_plan
from octopipe.transform import visible_gpus

__all__ = ["OnStep", "merge_results", "run_local", "run_local_many"]

#: called with each rank's completed step, in the launching process
OnStep = Callable[[StepTimeline], None]


def run_local(plan: plan_pb2.Plan, options: RunOptions | None = None, on_step: OnStep | None = None) -> RunResult:
    """Run ``plan`` on local ranks (CPU and gloo, or ``options.device`` cuda: rank r on GPU r) on 127.0.0.1 as
    ``options`` say; see ``run_local_many``. Results come back as CPU tensors."""
    return run_local_many([plan], options, on_step=on_step)[0]


def run_local_many(
    plans: Sequence[plan_pb2.Plan], options: RunOptions | None = None, on_step: OnStep | None = None
) -> list[RunResult]:
    """Run each plan for ``options.steps`` optimizer steps, one after the other, in one launch of local CPU ranks.

    The plans must have the same number of ranks (and normally the same model);
    each starts from the same freshly built weights. One launch saves the
    process start-up and reuses compiled stages between plans. ``RunOptions``
    documents every option (pinning, checkpoints, the numerics guard, memory). ``on_step`` is called in
    this process with each rank's ``StepTimeline`` as the rank completes a step (a progress bar's feed).
    """
    options = options or RunOptions()
    if not plans:
        raise ValueError("give at least one plan")
    meshes: list[MeshSpec] = []
    for plan in plans:
        verify_plan(plan)  # raises a VerificationError (a PlanError) naming rank, step and action
        meshes.append(mesh_spec(plan))
    world = meshes[0].world_size
    if any(mesh.world_size != world for mesh in meshes):
        raise ValueError(
            "plans run together must need the same number of processes (pipeline ranks x dp): "
            f"{[mesh.world_size for mesh in meshes]}"
        )
    if options.emulate is not None:  # nothing is built or computed: what emulation cannot take, and memory
        problem = emulation_problem(plans, options.emulate, options)
    else:
        problem = _model_problem(plans, options, world)
    if problem:
        raise ValueError(problem)
    log = structlog.get_logger("octopipe.launcher")
    sharing = shared_cores(world, options.cpus) if options.pin_cores and options.emulate is None else ""
    if sharing and options.strict_pinning:
        raise ValueError(f"{sharing}: run fewer ranks, give more cores, or drop strict pinning")
    if sharing:
        log.warning("ranks_share_cores", problem=sharing)
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=options.timeout_s)
    )
    context = multiprocessing.get_context("spawn")
    events = context.Queue() if on_step is not None else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="octopipe-run-") as folder:
        processes = [
            context.Process(
                target=worker_main,
                args=(
                    WorkerConfig.for_rank(
                        options,
                        plans=[plan.SerializeToString() for plan in plans],
                        rank=r,
                        world_size=world,
                        store_host="127.0.0.1",
                        store_port=port,
                        result_dir=folder,
                    ),
                    events,
                ),
                name=f"octopipe-rank{r}",
            )
            for r in range(world)
        ]
        for process in processes:
            process.start()
        log.info("ranks_started", ranks=world, plans=[plan.name for plan in plans], steps=options.steps)
        feed = None if events is None or on_step is None else (events, on_step)
        _watch(processes, store, started + options.timeout_s * (options.steps + 2) * len(plans), feed=feed)
        wall = time.monotonic() - started
        errors = sorted(Path(folder).glob("rank*.error"), key=lambda p: p.stat().st_mtime)
        if errors or any(p.exitcode != 0 for p in processes):
            first = errors[0].read_text().split("\n\n")[0] if errors else _no_message(processes)
            codes = {p.name: p.exitcode for p in processes}
            raise RunFailed(f"{first} (exit codes {codes})")
        results = [
            torch.load(Path(folder) / f"rank{r}.pt", weights_only=True, map_location="cpu") for r in range(world)
        ]
    merged = merge_results(plans, results, wall)
    log.info("run_finished", wall_s=round(wall, 2), losses=[[round(x, 5) for x in r.losses] for r in merged])
    return merged


def _no_message(processes: Sequence[Any]) -> str:
    """What to say when no rank wrote an error: which died of which signal (stderr has its threads' stacks)."""
    killed = [f"{p.name} by {signal.Signals(-p.exitcode).name}" for p in processes if p.exitcode and p.exitcode < 0]
    if not killed:
        return "a rank died without a message"
    return (
        f"a rank died without a message, killed by a signal ({', '.join(killed)}; its stderr has every thread's stack)"
    )


def _model_problem(plans: Sequence[plan_pb2.Plan], options: RunOptions, world: int) -> str:
    """Why the plans' model cannot run as ``options`` say ('' when it can), before any rank starts."""
    problem = next(filter(None, map(precision_problem, plans)), "")
    problem = problem or next((p for plan in plans if (p := optimization_problem(plan, options.optimization))), "")
    problem = problem or next((p for plan in plans if (p := weights_problem(plan, options.weights))), "")
    problem = problem or next(filter(None, map(split_problem, plans)), "")  # tp / cp the model cannot take
    if options.weights is not None and options.weights.export and len(plans) > 1:
        problem = problem or "export the weights of one plan at a time: run_local_many ran several"
    return problem or gpu_problem(options.device, world, len(visible_gpus()))


def merge_results(
    plans: Sequence[plan_pb2.Plan], results: Sequence[list[dict[str, Any]]], wall_s: float = 0.0
) -> list[RunResult]:
    """One RunResult per plan from every rank's result file (``rank<r>.pt``: a list with an entry per plan,
    in global rank order); the loss is the mean of the replicas' last stages'."""
    merged: list[RunResult] = []
    for index, plan in enumerate(plans):
        mesh = mesh_spec(plan)
        # every replica's and context rank's last stage (tensor rank 0): means over equal slices of the batch
        tensor = range(mesh.tp) if mesh.sequence_parallel else range(1)  # sp: each tp rank's loss is its slice's
        ends = [
            mesh.global_rank(plan.stages[-1].rank, d, c, t)
            for d in range(mesh.dp)
            for c in range(mesh.cp)
            for t in tensor
        ]
        last = [results[r][index]["losses"] for r in ends]
        losses = [sum(step) / len(ends) for step in zip(*last, strict=True)] if len(ends) > 1 else list(last[0])
        result = RunResult(
            losses=losses,
            wall_s=wall_s,
            grad_norms=list(results[0][index].get("grad_norms", [])),
            emulated=bool(results[0][index].get("emulated", False)),
        )
        for per_rank in results:
            entry = per_rank[index]
            result.grads.update(entry["grads"])
            result.params.update(entry["params"])
            result.timelines[int(entry["rank"])] = [StepTimeline.from_dict(t) for t in entry["timelines"]]
            result.channels[int(entry["rank"])] = entry["channels"]
            result.cores[int(entry["rank"])] = list(entry["cores"])
            if entry.get("host_memory") is not None:
                result.host_memory[int(entry["rank"])] = dict(entry["host_memory"])
            result.stage_backends.update({int(s): str(n) for s, n in entry.get("stage_backends", {}).items()})
            if entry.get("numerics") is not None:
                result.numerics[int(entry["rank"])] = dict(entry["numerics"])
            if entry.get("tied_grads") or entry.get("tied_params"):
                result.tied_grads[int(entry["rank"])] = dict(entry["tied_grads"])
                result.tied_params[int(entry["rank"])] = dict(entry["tied_params"])
            if entry.get("flops_per_step") is not None:
                result.flops_per_step[int(entry["rank"])] = float(entry["flops_per_step"])
            if entry.get("param_bytes") is not None:
                result.param_bytes[int(entry["rank"])] = int(entry["param_bytes"])
            if entry.get("memory") is not None:
                result.memory[int(entry["rank"])] = dict(entry["memory"])
        merged.append(result)
    return merged


def _drain(feed: tuple[Any, OnStep] | None) -> None:
    if feed is None:
        return
    events, on_step = feed
    while True:
        try:
            on_step(events.get_nowait())
        except queue.Empty:
            return


def _watch(
    processes: list[Any],
    store: dist.TCPStore,
    deadline: float,
    grace_s: float = 10.0,
    feed: tuple[Any, OnStep] | None = None,
) -> None:
    """Wait for every rank; on the first failure raise the abort flag, then kill stragglers after a grace period.
    ``feed``: a queue of the ranks' completed steps and what to call with each."""
    failed_at: float | None = None
    while any(p.is_alive() for p in processes):
        _drain(feed)
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = now
            if not store.check([ABORT_KEY]):
                store.set(ABORT_KEY, "another rank exited with an error")
        if now > deadline and failed_at is None:
            failed_at = now - grace_s
            store.set(ABORT_KEY, "the run exceeded its time limit")
        if failed_at is not None and now > failed_at + grace_s:
            for process in processes:
                if process.is_alive():
                    process.kill()
        time.sleep(0.05)
    for process in processes:
        process.join(timeout=5)
    _drain(feed)
