"""One rank's process: join the group, build and capture its stages, run the steps, report.

A worker runs one or more plans (same model and ranks) one after the other,
each from freshly built weights; stages captured for one plan are reused by the
next when their layers and input shapes match. A model whose source asks for
whole-model capture (transformers models by default, see runtime.models) is
captured as written and split at the plan's layer boundaries
(runtime.whole_model); before the first step its pipelined forward must
reproduce the model's own loss (the numerics guard, unless ``numerics_check``
is off), and tied parameters' gradients are summed across the ranks holding a
copy before every optimizer step. Checkpoints go through one ``runtime.checkpointer.Checkpointer`` per
process (synchronous, or written in the background while the next steps run); a plan's run returns only
after its last checkpoint is committed. Results go to ``<result_dir>/rank<r>.pt`` (loaded with ``weights_only=True``);
a failure goes to ``<result_dir>/rank<r>.error`` and to the run's store, which
every other rank watches while it waits, so all ranks stop together.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from octopipe.capture import StageModule
from octopipe.execute.processes import die_with_parent
from octopipe.execute.runs import (
    ABORT_KEY,
    PLAN_KEY,
    ActionRecord,
    StepEvents,
    StepTimeline,
    WorkerConfig,
    same_layout,
)
from octopipe.execute.runtime.checkpoint import load_checkpoint
from octopipe.execute.runtime.checkpointer import Checkpointer
from octopipe.execute.runtime.comm import Channels, channel_groups, program_channels
from octopipe.execute.runtime.data import with_data
from octopipe.execute.runtime.emulate import run_emulated_plan
from octopipe.execute.runtime.interpreter import RankRuntime
from octopipe.execute.runtime.memory import MemoryMeasurement, resident_bytes
from octopipe.execute.runtime.mesh import MeshRank
from octopipe.execute.runtime.models import BuiltModel, build_model, on_device
from octopipe.execute.runtime.optim import clip_global_norm, make_optimizer, set_learning_rate
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.execute.runtime.precision import Weights, in_precision, plan_dtype
from octopipe.execute.runtime.pretrained import (
    WeightSource,
    export_shard,
    finish_export,
    materialize,
    params_on_meta,
    resident_param_bytes,
    stage_parameter_names,
)
from octopipe.execute.runtime.stages import rank_stages, split_batch
from octopipe.execute.runtime.whole_model import buffer_specs, guard, guard_stages, reduce_tied, tied_indices
from octopipe.ir import Program, compile_plan, stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import (
    Device,
    StageCompiler,
    StageExecutable,
    configure_host_memory,
    graph_flops,
    use_compile_cache_dirs,
)
from octopipe.transform.inductor import compiled_tolerance, stage_backend

__all__ = ["StepEvents", "publish_plan", "worker_main"]


class _Recorder:
    """Collects each action's record; can fail after a given number of actions (fault tests)."""

    def __init__(self, fail_after: int | None) -> None:
        self.records: list[ActionRecord] = []
        self.fail_after = fail_after

    def __call__(self, record: ActionRecord) -> None:
        self.records.append(record)
        if self.fail_after is not None and len(self.records) == self.fail_after:
            raise RuntimeError(f"injected failure after {self.fail_after} actions")


def worker_main(config: WorkerConfig, events: StepEvents | None = None) -> None:
    """Entry point of a rank process (spawned by the launcher, a node daemon or torchrun).

    ``events`` (a multiprocessing queue) receives one dict per completed step:
    rank, step, loss (last stage only), step duration, the action records and
    the checkpoint step if this step started one (``StepTimeline.checkpoint``).
    """
    rank = config.rank
    out = Path(config.result_dir)
    (out / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
    # a native crash (an abort, a segfault) prints every thread's Python stack to stderr: without it a rank
    # killed by a signal leaves only its exit code
    faulthandler.enable(all_threads=True)
    if config.die_with_parent:
        die_with_parent()
    cores: list[int] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if config.pin_cores and not config.emulate:  # from the online CPUs (or config.cpus), not the inherited mask
        cores, warning = pin_rank(rank, config.cpus)
        if warning:
            structlog.get_logger("octopipe.worker").warning("rank_pinning", rank=rank, problem=warning)
    torch.set_num_threads(1)
    memory = configure_host_memory(config.host_memory)  # before the rank allocates its model (transform.host_memory)
    use_compile_cache_dirs()  # Inductor's cache beside octopipe's compile index, unless the user chose one
    device = Device.parse(config.device)
    if config.deterministic:
        device.make_deterministic()
    store = dist.TCPStore(
        config.store_host,
        config.store_port,
        is_master=config.store_is_master,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    try:
        device.activate()  # a device this machine lacks fails here, in one line, before the group forms
        dist.init_process_group(
            device.backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=config.world_size,
            timeout=datetime.timedelta(seconds=config.timeout_s),
        )
        result = _run(config, store, events, device)
        for entry in result:
            entry["cores"] = cores  # where this rank ran, for every benchmark's record
            entry["host_memory"] = memory.as_json()
        dist.destroy_process_group()  # not after a failure: a channel thread may still wait inside gloo
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException as exc:
        message = str(exc) if str(exc) else type(exc).__name__
        (out / f"rank{rank}.error").write_text(f"{message}\n\n{traceback.format_exc()}")
        try:
            if not store.check([ABORT_KEY]):
                store.set(ABORT_KEY, f"rank {rank} failed: {message.splitlines()[0]}")
        except Exception:  # the store may be gone; the launcher still sees the exit code
            pass
        # leave at once: interpreter finalization would wait on (or abort over) channel threads still inside gloo
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def publish_plan(store: dist.Store, switch: int, plan: plan_pb2.Plan) -> None:
    """Offer ``plan`` as the run's ``switch``-th plan switch (1, 2, ...) to adaptive ranks."""
    store.set(f"{PLAN_KEY}/{switch}", plan.SerializeToString())  # type: ignore[arg-type]  # bytes are taken as-is


def _next_plan(
    store: dist.Store, rank: int, switches: int, plan: plan_pb2.Plan, device: Device
) -> plan_pb2.Plan | None:
    """Whether every rank switches plans now: rank 0 looks in the store and tells the others (a collective)."""
    key = f"{PLAN_KEY}/{switches + 1}"
    flag = device.put(torch.tensor([1 if rank == 0 and store.check([key]) else 0], dtype=torch.int64))
    dist.broadcast(flag, src=0)
    if not flag.item():
        return None
    new = plan_pb2.Plan.FromString(store.get(key))
    problem = same_layout(plan, new)
    if problem:
        raise RuntimeError(f"plan switch {switches + 1} refused: {problem}; a switch may change only the schedule")
    return new


def _measure_memory(
    config: WorkerConfig,
    built: BuiltModel,
    runtime: RankRuntime,
    stages: list[StageModule],
    mine: list[int],
    optimizer: torch.optim.Optimizer,
    device: Device,
) -> dict[str, int]:
    """One more pipeline step of the next batch under the allocator meter; parameters are not updated."""
    step = config.start_step + config.steps
    held = [t for s in mine for t in (*stages[s].parameters(), *stages[s].buffers())]
    held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    held += [p for group in optimizer.param_groups for p in group["params"]]  # float32 masters of bf16 weights
    resident = resident_bytes(held)
    microbatches = split_batch(*built.batch(step), runtime.program.num_microbatches)
    dist.barrier()
    with device.memory_window() as meter:
        runtime.run_step(step, microbatches)
    runtime.zero_grads()
    return MemoryMeasurement(resident, meter.peak_bytes, meter.end_bytes, meter.allocations).as_json()


def _run(
    config: WorkerConfig, store: dist.TCPStore, events: StepEvents | None, device: Device
) -> list[dict[str, object]]:
    if config.emulate:  # no model, no optimizer: the programs with emulated computations (runtime.emulate)
        plans = [plan_pb2.Plan.FromString(data) for data in config.plans]
        return [run_emulated_plan(config, plan, store, device, i, events) for i, plan in enumerate(plans)]
    # one per run: a plan switch that keeps a stage's layers reuses its graphs
    compiler = StageCompiler(backend=stage_backend(config.compile), fallback=config.compile_fallback)
    checkpointer = None
    if config.checkpoint_every and config.checkpoint_dir:  # a collective: its own gloo group and the token

        def aborted() -> str | None:
            return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None

        checkpointer = Checkpointer(
            config.checkpoint_dir,
            asynchronous=config.checkpoint_async,
            keep=config.checkpoint_keep,
            timeout_s=config.timeout_s,
            aborted=aborted,
            hold=config.checkpoint_hold,
        )
    results = [
        _run_plan(config, plan_pb2.Plan.FromString(data), store, compiler, index, device, events, checkpointer)
        for index, data in enumerate(config.plans)
    ]
    if checkpointer is not None:
        checkpointer.close()
    return results


def _run_plan(
    config: WorkerConfig,
    plan: plan_pb2.Plan,
    store: dist.TCPStore,
    compiler: StageCompiler,
    plan_index: int,
    device: Device,
    events: StepEvents | None = None,
    checkpointer: Checkpointer | None = None,
) -> dict[str, object]:
    rank, m = config.rank, plan.num_microbatches
    mesh = MeshRank.create(plan, rank, config.world_size)  # a pp x dp mesh's groups (collective); see runtime.mesh
    prank = mesh.pipeline_rank  # the pipeline rank whose program this process runs (= rank without a mesh)
    placement = stage_ranks(plan)
    # built from the seed on the CPU in float32, cast to the plan's compute dtype, then moved: every device
    # and precision starts from the same weights and data. Loaded weights: built with meta parameters, each
    # rank then reads its own stages' tensors (runtime.pretrained)
    source = WeightSource(config.weights.load) if config.weights is not None and config.weights.load else None
    with params_on_meta() if source is not None else contextlib.nullcontext():
        built = build_model(plan.model, seed=config.seed)
    if config.data is not None:  # the same global batch from files, before each replica takes its slice
        built = with_data(built, config.data)
    ndims = {name: p.ndim for name, p in built.model.named_parameters()}  # the model's order, before any shard
    built = on_device(in_precision(mesh.replica_model(built, m), plan_dtype(plan)), device)
    mine = sorted(s for s, r in placement.items() if r == prank)
    model = built.model

    def load_mine(stages: Sequence[torch.nn.Module], mine: Sequence[int]) -> None:
        assert source is not None
        materialize(model, stages, stage_parameter_names(model, stages, mine), source, device)

    # every stage module; this rank's compiled
    compiled = rank_stages(plan, built, mine, mesh, compiler, materialize=load_mine if source is not None else None)
    param_bytes = resident_param_bytes(model)
    stages, executables, boundaries = compiled.modules, compiled.executables, compiled.boundaries
    whole, first = compiled.whole, compiled.first

    plain = {s: e for s, e in executables.items() if isinstance(e, StageExecutable)}
    # matmul and attention FLOPs of a step on this rank, from its captured graphs (a recompute counted)
    flops = m * sum(graph_flops(e.graphs.forward) + graph_flops(e.graphs.backward) for e in plain.values())
    ties = whole.ties if whole is not None else []

    tied_names = {name for tie in ties for _, name in tie.uses}

    def holder(stage: int) -> int:  # the process that runs ``stage``
        return mesh.peers[placement[stage]]

    def aborted() -> str | None:
        return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None

    def directions(program: Program) -> list[tuple[int, int]]:  # every replica's channels, in global ranks
        spec = mesh.spec
        pairs = program_channels(program)
        return [
            (spec.global_rank(a, d, c, t), spec.global_rank(b, d, c, t))
            for d in range(spec.dp)
            for c in range(spec.cp)
            for t in range(spec.tp)
            for a, b in pairs
        ]

    groups = channel_groups(directions(compile_plan(plan)))  # collective: one group per direction, every rank

    def make_runtime(current: plan_pb2.Plan) -> RankRuntime:
        program = compile_plan(current)  # the one program the simulator timed and the verifier checked
        # a switch keeps the layout (same_layout), so its messages take the directions opened above
        channels = Channels(
            program=program,
            rank=prank,
            groups=groups,
            peers=mesh.peers,
            buffer_spec=buffer_specs(program, boundaries),
            timeout_s=config.timeout_s,
            aborted=aborted,
            device=device,
        )
        return RankRuntime(
            rank=prank,
            program=program,
            stages=executables,
            channels=channels,
            per_microbatch=tied_indices(ties, plain),  # tied weights: summed across ranks per micro-batch
            compiler=compiler,
        )

    runtime = make_runtime(plan)
    notes = tuple(compiler.notes[s] for s in mine if s in compiler.notes)  # which graphs run compiled
    switches = 0
    named = {name: param for s in mine for name, param in stages[s].named_parameters()}
    params: dict[str, torch.nn.Parameter] = {}  # a tied parameter once (two stages of this rank may hold it)
    for name, param in named.items():
        if all(param is not p for p in params.values()):
            params[name] = param
    canonical = {name: next(n for n, p in params.items() if p is param) for name, param in named.items()}
    weights = Weights(params)  # what the optimizer steps: the parameters, or float32 masters of bf16 ones
    numerics = None
    if whole is not None and config.numerics_check:  # refuse to train a pipeline that computes something else
        assert built.input_names is not None
        # compiled stages agree with their own ops to rounding (Inductor reorders arithmetic): the stated tolerance
        tolerance = compiled_tolerance(plan_dtype(plan)) if compiler.compiled_stages else (0.0, 0.0)
        if source is not None:  # no rank holds every weight: stage by stage, outputs passed on
            numerics = guard_stages(whole, plain, first, built.input_names, boundaries, holder, tolerance=tolerance)
        else:
            report = guard(whole, plain, first, built.input_names, tolerance=tolerance)
            numerics = {"reference_loss": report.reference_loss, "pipelined_loss": report.pipelined_loss}
            numerics["seconds"] = report.seconds
    optimization = config.optimization
    optimizer = make_optimizer(weights.optimized, ndims, optimization)
    # a tied parameter's norm is counted by the holder of its first use (every holder has the summed gradient)
    counted = {n for n in params if n not in tied_names and mesh.counts_norm(n)}
    counted |= {t.uses[0][1] for t in ties if holder(t.uses[0][0]) == rank and t.uses[0][1] in params}
    grad_norms: list[float] = []
    losses: list[float] = []
    timelines: list[StepTimeline] = []
    first_grads: dict[str, torch.Tensor] = {}
    # a mesh's replicas hold different shards and experts under the same names: keep them apart
    dp, suffix = mesh.spec.dp, mesh.suffix
    if config.resume:
        load_checkpoint(config.checkpoint_dir, config.start_step, weights.optimized, optimizer, suffix=suffix)
        weights.publish()
    for step in range(config.start_step, config.start_step + config.steps):
        microbatches = split_batch(*built.batch(step), m)
        fail_after = config.fail_at[1] if config.fail_at is not None and config.fail_at[0] == step else None
        recorder = _Recorder(fail_after)
        if config.adaptive:
            switched = _next_plan(store, rank, switches, plan, device)
            if switched is not None:  # a newer plan (same layout) from the closed loop, from this step on
                plan, switches = switched, switches + 1
                runtime.close()
                runtime = make_runtime(plan)
        dist.barrier()  # ranks start each step together, so measured timelines line up
        watch = device.stopwatch()  # the step's times on the device: CUDA events on a GPU
        watch.mark()
        loss = runtime.run_step(step, microbatches, on_action=recorder, stopwatch=watch)
        for s in mine:
            names = executables[s].graphs.param_names
            for name, grad in zip(names, runtime.grads[s], strict=True):
                weights.set_grad(canonical[name], grad)
        if ties:  # a collective: every rank, every step, the same order
            for (_, name), grad in reduce_tied(ties, stages, runtime, plain, holder).items():
                weights.set_grad(canonical[name], grad)
        mesh.average_split({n: weights.grad(n) for n in params})  # cp > 1 or sequence parallel: a collective
        watch.mark()  # the step ends here: the tied-gradient exchange is part of it (as simulated)
        if step == config.start_step and config.keep_grads:
            first_grads = {n: g.clone() for n in params if (g := weights.grad(n)) is not None}
        if optimization.clip_grad_norm:  # a collective: every rank, every step
            grads = {n: weights.grad(n) for n in params}
            split = dp > 1 or mesh.split_layers  # slices of one tensor on several ranks: add squared norms
            norm = clip_global_norm(grads, list(ndims), optimization.clip_grad_norm, counted=counted, sharded=split)
            grad_norms.append(norm)
        set_learning_rate(optimizer, optimization, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.publish()
        runtime.zero_grads()
        # the one wait for the device a step makes: after the update was queued, to read the step's times
        timeline = runtime.timeline(
            step,
            watch,
            recorder.records,
            loss,
            rank=rank,
            plan_switches=switches,
            stage_backends=notes if step == config.start_step else (),
        )
        if loss is not None:
            losses.append(float(loss))
        if checkpointer is not None and (step + 1) % config.checkpoint_every == 0:
            checkpointer.save(step + 1, weights.optimized, optimizer, suffix=suffix)
            timeline = replace(timeline, checkpoint=step + 1)  # the step whose checkpoint starts now
        timelines.append(timeline)
        if events is not None:
            events.put(timeline)
    if config.weights is not None and config.weights.export:  # this rank's shard; rank 0 then the index
        first_names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter's other names
        aliases: dict[str, list[str]] = {}
        for alias, param in model.named_parameters(remove_duplicate=False):
            if alias != first_names[id(param)]:
                aliases.setdefault(first_names[id(param)], []).append(alias)
        kept = {n: p for n, p in weights.optimized.items() if n in counted}
        known = source.names if source is not None else []
        export_shard(config.weights.export, kept, aliases, rank, config.world_size, known)
        dist.barrier()
        if rank == 0:
            finish_export(config.weights.export, config.world_size, source)
    if checkpointer is not None:  # the plan's last checkpoint committed (and a failed one raised) before it ends
        checkpointer.finish()
    memory = _measure_memory(config, built, runtime, stages, mine, optimizer, device) if config.measure_memory else None
    runtime.close()
    return {
        "memory": memory,
        "param_bytes": param_bytes,
        "flops_per_step": flops if len(plain) == len(mine) else None,
        "plan": plan_index,
        "rank": rank,
        "stage_backends": {s: compiler.notes[s] for s in mine if s in compiler.notes},  # the launcher's report
        "numerics": numerics,
        # each copy of a tied parameter this rank holds (the names above are shared by the ranks holding one)
        "tied_grads": {n: g for n, g in first_grads.items() if n in tied_names},
        "tied_params": {n: p.detach() for n, p in weights.optimized.items() if n in tied_names}
        if config.keep_params
        else {},
        "losses": losses,
        "grad_norms": grad_norms,
        "grads": mesh.full(first_grads),  # whole tensors from the shards (a collective when dp > 1)
        "params": mesh.full({n: p.detach() for n, p in weights.optimized.items()}) if config.keep_params else {},
        "timelines": [t.as_dict() for t in timelines],
        # each channel's transfers in the order they started, all steps of the last program
        "channels": {f"{d} {peer}": list(order) for (d, peer), order in runtime.channels.started.items()},
    }
