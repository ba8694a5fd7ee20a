"""What a run is told and what it reports, without torch: the caller's :class:`RunOptions`, each rank's
:class:`WorkerConfig`, the :class:`RunResult` (or :class:`RunFailed`), the keys ranks share in their
rendezvous store, and the rule for switching plans mid-run.

The CLI, the control plane and the launcher build these; only rank processes
(``runtime.worker``) import torch. Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from octopipe.execute.devices import RUN_DEVICES, rank_device
from octopipe.execute.training import DataSpec, Optimization, WeightsSpec
from octopipe.ir import (
    PlanError,
    action_from_proto,
    action_to_proto,
    compute_dtype,
    format_action,
    mesh_spec,
    parse_action,
)
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2

if TYPE_CHECKING:
    import torch

__all__ = [
    "ABORT_KEY",
    "PLAN_KEY",
    "WORKLOAD_SOURCE",
    "ActionRecord",
    "RunFailed",
    "RunOptions",
    "RunResult",
    "StepEvents",
    "StepTimeline",
    "WorkerConfig",
    "optimization_problem",
    "precision_problem",
    "same_layout",
    "weights_problem",
]

#: a Plan's ``model.source`` for the built-in workloads (``octopipe.examples``); every daemon allows it
WORKLOAD_SOURCE = "octopipe.examples:workload"

#: set in the run's store by whoever sees a failure first; every rank leaves its waits when it appears
ABORT_KEY = "octopipe/abort"
#: ``<PLAN_KEY>/<n>``: the n-th plan an adaptive run switches to (``runtime.worker.publish_plan``)
PLAN_KEY = "octopipe/plan"


#: how a run's stage graphs run (``transform.inductor.BACKENDS``; kept here so the control plane needs no torch)
STAGE_BACKENDS = ("eager", "inductor", "auto")
#: how a rank's C allocator keeps freed host memory (``transform.host_memory.HOST_MEMORY_POLICIES``; kept here
#: for the same reason)
HOST_MEMORY_POLICIES = ("reuse", "system")


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """How ``runtime.run_local`` / ``run_local_many`` run plans on local CPU ranks (gloo, 127.0.0.1).

    ``steps`` optimizer steps each, from weights built with ``seed``; every wait of a rank gives up after
    ``timeout_s``. With ``pin_cores`` rank r runs on ``cpus[r % len(cpus)]`` (default: the machine's
    online CPUs, whatever mask this process has); ranks that must share cores are a warning, or a
    ValueError with ``strict_pinning``. ``keep_grads`` / ``keep_params`` return the first step's
    gradients and the final parameters. ``fail_at`` maps a rank to (step, action index) where it raises
    (fault tests). ``checkpoint_dir`` / ``checkpoint_every`` save checkpoints (``runtime.checkpoint``), each
    written to a partial folder and committed to ``step-<n>`` once every rank's data is in
    (``checkpoint_files``); ``checkpoint_async`` writes them on a background thread while the next steps
    run (``runtime.checkpointer``; the run ends after its last one is committed); ``checkpoint_keep`` K > 0
    keeps only the newest K committed checkpoints. ``checkpoint_hold`` maps a rank to (step, seconds) it
    waits, after writing its data of that step's checkpoint, before reporting the write (fault tests kill a
    rank there). ``start_step`` with ``resume`` continues from ``checkpoint_dir/step-<start_step>``.
    ``numerics_check`` (whole-model capture): before the first step every rank checks that its stages
    reproduce the model's own forward on one micro-batch and refuses to train, naming the stage, if not.
    ``measure_memory`` runs one more pipeline step (no update) after the timed ones under the allocator
    meter (``RunResult.memory``). ``device``: ``cpu`` (gloo) or ``cuda`` (NCCL; local rank r on GPU r of
    its machine, ``octopipe.execute.devices``). ``deterministic``: torch's deterministic kernels on every
    rank (``transform.Device.make_deterministic``; on CUDA a run is then bitwise reproducible).
    ``optimization``: the optimizer, its schedule and gradient clipping (``training.Optimization``;
    default AdamW at 1e-3). ``data``: batches from text files (``training.DataSpec``) instead of the
    model's own. ``weights``: initial weights read stage by stage from a checkpoint folder, and where the
    trained weights are exported (``training.WeightsSpec``). ``compile``: ``eager`` runs the split graphs
    as captured; ``inductor`` compiles each stage's F, B, I and W graphs (``transform.inductor``) and
    records in the compile index which ran faster; ``auto`` (the CLI's default) compiles a stage's graphs
    only where that index has seen them all (Inductor's cache is warm) and only those that ran faster
    (``transform.compile_cache``), else runs them as captured; ``compile_fallback`` lets a graph that fails
    to compile run eagerly instead of failing the run (always so under ``auto``). ``RunResult.stage_backends``
    says what ran.
    ``host_memory``: ``reuse`` (default) makes each CPU rank's C allocator keep freed blocks for reuse instead
    of mapping fresh, page-faulting memory for every activation (``transform.host_memory``); ``system``
    leaves the C library's defaults.
    ``emulate``: a Profile: compute nothing, and run every rank's real program with each computation waiting
    for its profiled duration (``runtime.emulate``; no model is built, ranks are not pinned, and
    ``RunResult.emulated`` says so).
    """

    steps: int = 1
    seed: int = 0
    timeout_s: float = 60.0
    optimization: Optimization = field(default_factory=Optimization)
    data: DataSpec | None = None
    weights: WeightsSpec | None = None
    pin_cores: bool = True
    cpus: Sequence[int] = ()
    strict_pinning: bool = False
    keep_grads: bool = False
    keep_params: bool = False
    fail_at: dict[int, tuple[int, int]] = field(default_factory=dict)
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    checkpoint_async: bool = False
    checkpoint_keep: int = 0
    checkpoint_hold: dict[int, tuple[int, float]] = field(default_factory=dict)
    start_step: int = 0
    resume: bool = False
    numerics_check: bool = True
    measure_memory: bool = False
    device: str = "cpu"
    deterministic: bool = False
    compile: str = "eager"
    compile_fallback: bool = False
    host_memory: str = "reuse"
    emulate: profile_pb2.Profile | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", tuple(self.cpus))  # a list given by a caller becomes a tuple
        problems = []
        if self.device not in RUN_DEVICES:
            problems.append(f"device must be one of {', '.join(RUN_DEVICES)}, got {self.device!r}")
        if self.compile not in STAGE_BACKENDS:
            problems.append(f"compile must be one of {', '.join(STAGE_BACKENDS)}, got {self.compile!r}")
        if self.host_memory not in HOST_MEMORY_POLICIES:
            problems.append(f"host_memory must be one of {', '.join(HOST_MEMORY_POLICIES)}, got {self.host_memory!r}")
        if self.steps < 0:  # 0: nothing to run (a run resumed from its last step's checkpoint)
            problems.append(f"steps must be >= 0, got {self.steps}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if any(c < 0 for c in self.cpus):
            problems.append(f"cpus must be core numbers >= 0, got {list(self.cpus)}")
        if self.checkpoint_every < 0 or self.start_step < 0:
            problems.append("checkpoint_every and start_step must be >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            problems.append("checkpoint_every needs a checkpoint_dir")
        if self.checkpoint_async and not self.checkpoint_every:
            problems.append("checkpoint_async needs checkpoint_every > 0 (the steps between checkpoints)")
        if self.checkpoint_keep < 0:
            problems.append(f"checkpoint_keep must be >= 0 (0: keep every checkpoint), got {self.checkpoint_keep}")
        if any(seconds < 0 for _, seconds in self.checkpoint_hold.values()):
            problems.append("checkpoint_hold's seconds must be >= 0")
        if self.resume and not self.checkpoint_dir:
            problems.append("resume needs the checkpoint_dir to resume from")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(kw_only=True, frozen=True)
class WorkerConfig:
    """One rank process's orders: the plans (serialized), where the store is, and how to run."""

    plans: tuple[bytes, ...]
    rank: int
    world_size: int
    store_host: str
    store_port: int
    #: host the rendezvous store here (rank 0 of a launch without a launcher-held store)
    store_is_master: bool = False
    result_dir: str
    steps: int = 1
    seed: int = 0
    timeout_s: float = 60.0
    optimization: Optimization = field(default_factory=Optimization)
    #: batches from files instead of the model's own (``runtime.data``)
    data: DataSpec | None = None
    #: initial weights loaded stage by stage, trained weights exported (``runtime.pretrained``)
    weights: WeightsSpec | None = None
    pin_cores: bool = True
    #: the cores rank r chooses from (``cpus[r % len(cpus)]``); empty: the machine's online CPUs
    cpus: tuple[int, ...] = ()
    keep_grads: bool = False
    keep_params: bool = False
    fail_at: tuple[int, int] | None = None  # (step, action index): raise there, for fault tests
    #: the first step's index (a resumed run starts after its checkpoint); ``steps`` steps run from here
    start_step: int = 0
    #: checkpoints (see runtime.checkpoint) go here every ``checkpoint_every`` completed steps
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    #: save them on a background thread while the next steps run (``runtime.checkpointer``)
    checkpoint_async: bool = False
    #: keep only the newest this many committed checkpoints (0: all)
    checkpoint_keep: int = 0
    #: (step, seconds): after writing its data of that step's checkpoint, wait this long (fault tests)
    checkpoint_hold: tuple[int, float] | None = None
    #: load ``checkpoint_dir/step-<start_step>`` before the first step
    resume: bool = False
    #: Linux: the kernel kills this rank when the process that started it dies (a node daemon's ranks)
    die_with_parent: bool = False
    #: at every step boundary, take a newer plan from the store if one was published (``publish_plan``)
    adaptive: bool = False
    #: whole-model capture: check before the first step that the pipelined forward reproduces the model's loss
    numerics_check: bool = True
    #: after the timed steps, one more pipeline step (no optimizer update) under the allocator meter
    #: (runtime.memory); its result is each plan's ``memory``
    measure_memory: bool = False
    #: where this rank computes: ``cpu`` or ``cuda:N`` (``transform.Device.parse``)
    device: str = "cpu"
    #: torch's deterministic kernels (``transform.Device.make_deterministic``)
    deterministic: bool = False
    #: how stage graphs run: ``eager`` or ``inductor`` (``transform.inductor``), and whether a graph that fails
    #: to compile may run eagerly
    compile: str = "eager"
    compile_fallback: bool = False
    #: how the rank's C allocator keeps freed host memory (``transform.host_memory``)
    host_memory: str = "reuse"
    #: a serialized Profile: run the program with emulated computations (``runtime.emulate``); empty: compute
    emulate: bytes = b""

    @classmethod
    def for_rank(
        cls,
        options: RunOptions,
        *,
        plans: Sequence[bytes],
        rank: int,
        world_size: int,
        store_host: str,
        store_port: int,
        result_dir: str,
        store_is_master: bool = False,
        die_with_parent: bool = False,
        adaptive: bool = False,
        local_rank: int | None = None,
    ) -> WorkerConfig:
        """Rank ``rank``'s orders from the run's options: the one place a WorkerConfig is built (the local
        launcher, the node daemon and ``octopipe run --torchrun`` all call it). ``local_rank``: the rank's
        index on its machine (its GPU with ``device="cuda"``); default ``rank`` (every rank on one machine)."""
        return cls(
            plans=tuple(plans),
            rank=rank,
            world_size=world_size,
            store_host=store_host,
            store_port=store_port,
            store_is_master=store_is_master,
            result_dir=result_dir,
            steps=options.steps,
            seed=options.seed,
            timeout_s=options.timeout_s,
            optimization=options.optimization,
            data=options.data,
            weights=options.weights,
            pin_cores=options.pin_cores,
            cpus=tuple(options.cpus),
            keep_grads=options.keep_grads,
            keep_params=options.keep_params,
            fail_at=options.fail_at.get(rank),
            start_step=options.start_step,
            checkpoint_dir=options.checkpoint_dir,
            checkpoint_every=options.checkpoint_every,
            checkpoint_async=options.checkpoint_async,
            checkpoint_keep=options.checkpoint_keep,
            checkpoint_hold=options.checkpoint_hold.get(rank),
            resume=options.resume,
            die_with_parent=die_with_parent,
            adaptive=adaptive,
            numerics_check=options.numerics_check,
            measure_memory=options.measure_memory,
            device=rank_device(options.device, rank if local_rank is None else local_rank),
            deterministic=options.deterministic,
            compile=options.compile,
            compile_fallback=options.compile_fallback,
            host_memory=options.host_memory,
            emulate=options.emulate.SerializeToString() if options.emulate is not None else b"",
        )


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran: times on the machine's monotonic clock (comparable across local ranks).

    ``start_ns``/``end_ns`` time the action's work on the rank's device (CUDA events on a GPU, aligned to
    the step's start on the host clock; the host clock on CPU, where the work is done when the call
    returns). ``host_start_ns``/``host_end_ns`` are the host clock around the call that queued it (0 where
    not recorded): on CPU the same times, on a GPU when the host issued the work.
    """

    action: str
    stream: str
    start_ns: int
    end_ns: int
    #: bytes of activations, gradients in flight and messages this rank's program holds after the action
    held_bytes: int
    #: the process's resident set size after the action (0 where it was not measured)
    rss_bytes: int = 0
    host_start_ns: int = 0
    host_end_ns: int = 0
    #: how long the program's thread waited, before ``start_ns``, for what the action consumes (its received
    #: messages and gathered parameters), host clock; 0 where it waited for nothing
    wait_ns: int = 0
    #: page faults (minor) the process took during the action's work (its allocations touching fresh memory)
    minor_faults: int = 0


@dataclass(frozen=True)
class StepTimeline:
    """One rank's one step as it ran: the record every reader takes, from the worker onward.

    The worker makes it; the launcher's results, the node daemon's step metrics,
    the Perfetto traces and the Profile protos are made from it. Times are the
    machine's monotonic clock in nanoseconds.
    """

    rank: int
    step: int
    start_ns: int
    end_ns: int
    records: tuple[ActionRecord, ...]
    loss: float | None = None
    plan_switches: int = 0
    #: the step whose checkpoint this step started, if it started one: committed before the next step with
    #: synchronous checkpoints; with asynchronous ones still being written (committed once a later step, or
    #: the run's end, has waited for it)
    checkpoint: int | None = None
    #: on a launch's first step: which of this rank's stages' graphs ran compiled, one line per stage
    stage_backends: tuple[str, ...] = ()

    @property
    def peak_held_bytes(self) -> int:
        return max((r.held_bytes for r in self.records), default=0)

    def to_proto(self, origin_ns: int | None = None) -> profile_pb2.RankTimeline:
        """As a ``RankTimeline``, times in microseconds from ``origin_ns`` (default: this step's start)."""
        origin = self.start_ns if origin_ns is None else origin_ns
        timeline = profile_pb2.RankTimeline(rank=self.rank, step=self.step, peak_memory_bytes=self.peak_held_bytes)
        for record in self.records:
            message = timeline.records.add(
                stream=record.stream,
                start_us=(record.start_ns - origin) / 1e3,
                end_us=(record.end_ns - origin) / 1e3,
                memory_after_bytes=record.held_bytes,
            )
            message.action.CopyFrom(action_to_proto(parse_action(record.action)))
        return timeline

    @classmethod
    def from_proto(
        cls, timeline: profile_pb2.RankTimeline, *, start_ns: int = 0, duration_us: float | None = None
    ) -> StepTimeline:
        """From a ``RankTimeline`` whose times count from ``start_ns``; the step ends after ``duration_us``
        (default: at its last action's end)."""
        records = tuple(
            ActionRecord(
                action=format_action(action_from_proto(r.action)),
                stream=r.stream,
                start_ns=start_ns + round(r.start_us * 1e3),
                end_ns=start_ns + round(r.end_us * 1e3),
                held_bytes=int(r.memory_after_bytes),
            )
            for r in timeline.records
        )
        begin = start_ns if duration_us is not None else min((r.start_ns for r in records), default=start_ns)
        end = (
            start_ns + round(duration_us * 1e3)
            if duration_us is not None
            else max((r.end_ns for r in records), default=start_ns)
        )
        return cls(rank=timeline.rank, step=timeline.step, start_ns=begin, end_ns=end, records=records)

    def as_dict(self) -> dict[str, Any]:
        """Plain values only (a rank's result file is loaded with ``torch.load(weights_only=True)``)."""
        return {
            "rank": self.rank,
            "step": self.step,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "loss": self.loss,
            "plan_switches": self.plan_switches,
            "checkpoint": self.checkpoint,
            "stage_backends": list(self.stage_backends),
            "records": [
                [
                    r.action,
                    r.stream,
                    r.start_ns,
                    r.end_ns,
                    r.held_bytes,
                    r.rss_bytes,
                    r.host_start_ns,
                    r.host_end_ns,
                    r.wait_ns,
                    r.minor_faults,
                ]
                for r in self.records
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimeline:
        records = tuple(ActionRecord(*values) for values in data["records"])
        return cls(
            rank=int(data["rank"]),
            step=int(data["step"]),
            start_ns=int(data["start_ns"]),
            end_ns=int(data["end_ns"]),
            records=records,
            loss=data["loss"],
            plan_switches=int(data["plan_switches"]),
            checkpoint=data["checkpoint"],
            stage_backends=tuple(data.get("stage_backends", ())),
        )


class StepEvents(Protocol):
    """Where a rank reports each completed step (a multiprocessing queue)."""

    def put(self, item: StepTimeline, /) -> None: ...


class RunFailed(RuntimeError):
    """A rank failed; the message is the first failure's, naming rank, step and action."""


@dataclass
class RunResult:
    """What the ranks reported: per-step losses (from the last stage), first-step grads, final params, timelines."""

    losses: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: rank -> its steps as they ran
    timelines: dict[int, list[StepTimeline]] = field(default_factory=dict)
    #: rank -> channel ("send <peer>" or "recv <peer>") -> its transfers in the order they started, every step
    channels: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    #: rank -> the cores it ran on (one each when pinned)
    cores: dict[int, list[int]] = field(default_factory=dict)
    #: rank -> what its host allocator policy did (``transform.HostMemoryState.as_json``)
    host_memory: dict[int, dict[str, object]] = field(default_factory=dict)
    #: stage -> what ran compiled, one line (``compile`` inductor or auto; empty for eager)
    stage_backends: dict[int, str] = field(default_factory=dict)
    #: rank -> the numerics guard's figures (reference and pipelined loss, seconds) for a whole-model capture
    numerics: dict[int, dict[str, float]] = field(default_factory=dict)
    #: rank -> each copy it holds of a tied parameter: first-step gradient and (``keep_params``) final value
    tied_grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tied_params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: rank -> the allocator-measured memory of one extra step (``measure_memory=True``; runtime.memory)
    memory: dict[int, dict[str, int]] = field(default_factory=dict)
    #: each step's global gradient norm before clipping (runs that clip; every rank computes the same)
    grad_norms: list[float] = field(default_factory=list)
    #: rank -> bytes of the parameters it holds after materializing its stages (all of the model's unless
    #: the weights were loaded stage by stage)
    param_bytes: dict[int, int] = field(default_factory=dict)
    #: rank -> matmul and attention FLOPs of one step of its stages, from the captured graphs (not for
    #: sharded stages)
    flops_per_step: dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0
    #: compute was emulated (``RunOptions.emulate``): the timelines are the runtime's with every computation
    #: waiting for its profiled duration; no loss, gradient or kernel time was computed
    emulated: bool = False


def same_layout(old: plan_pb2.Plan, new: plan_pb2.Plan) -> str:
    """Why ``new`` cannot replace ``old`` in a running job ('' when only the schedule differs)."""
    if [(tuple(s.layer_names), s.rank) for s in old.stages] != [(tuple(s.layer_names), s.rank) for s in new.stages]:
        return "its stages or their placement differ"
    if old.num_microbatches != new.num_microbatches or len(old.ranks) != len(new.ranks):
        return "its micro-batch or rank count differs"
    if old.mesh.SerializeToString(deterministic=True) != new.mesh.SerializeToString(deterministic=True):
        return "its mesh differs"
    return ""


def precision_problem(plan: plan_pb2.Plan) -> str:
    """Why the runtime cannot run ``plan``'s precision policy ('' when it can): an unknown compute dtype or
    a mesh the plan cannot have. bf16 runs with data parallelism too: gradients accumulate in float32 and
    FSDP reduce-scatters them in float32 (the interpreter checks it), the masters are float32 shards."""
    try:
        dtype, mesh = compute_dtype(plan), mesh_spec(plan)
    except PlanError as exc:
        return str(exc)
    del dtype, mesh  # both readable: the runtime runs every policy on every mesh
    return ""


def weights_problem(plan: plan_pb2.Plan, weights: WeightsSpec | None) -> str:
    """Why ``plan`` cannot load or export ``weights`` ('' when it can): stage-by-stage loading and export
    are built for pipelines without a mesh (dp = ep = tp = cp = 1: one process holds each whole tensor)."""
    if weights is None or not (weights.load or weights.export):
        return ""
    try:
        mesh = mesh_spec(plan)
    except PlanError as exc:
        return str(exc)
    if mesh.world_size > mesh.pp:
        return (
            f"loading or exporting weights with a mesh ({mesh.shape}, ep={mesh.ep}) is not built yet: run the plan "
            "without its mesh, or without weights.load / weights.export"
        )
    return ""


def optimization_problem(plan: plan_pb2.Plan, optimization: Optimization) -> str:
    """Why ``plan`` cannot run with ``optimization`` ('' when it can): clipping needs every gradient's norm
    once, and experts split over an expert-parallel group are not counted that way yet."""
    try:
        mesh = mesh_spec(plan)
    except PlanError as exc:
        return str(exc)
    if optimization.clip_grad_norm and mesh.ep > 1:
        return (
            f"gradient clipping with expert parallelism (ep={mesh.ep}) is not built yet: run without "
            "clip_grad_norm, or with ep=1"
        )
    return ""
