"""Emulated execution: the real runtime runs a plan whose computations wait for their profiled durations.

Every rank runs its real program through the one interpreter
(:class:`~octopipe.execute.runtime.interpreter.RankRuntime`): the same action
order, the same channels (one thread and one process group per direction,
strict order per channel), real gloo messages of the profiled boundary sizes,
and the interpreter's own memory accounting of what each action holds. Only a
computation (F, I, W, B, OVERLAP_F_B) is replaced: an :class:`EmulatedStage`
allocates tensors of the profiled sizes (activations saved by F, the stash I
leaves for W, the boundary tensors it sends) and waits, without computing,
until the action's profiled duration has passed. The durations are the ones the
simulator uses for the same plan and profile (``simulate.local_cost_model``:
``CostModel.duration_us`` and ``overlap_us``), so a difference between an
emulated step and its prediction is the runtime's own cost and the link's, never
a different cost model.

Because waiting takes no core, plans for 4-16 ranks run on a 2-core machine:
an emulated rank is a process of about :data:`EMULATED_RANK_BYTES` resident
bytes plus the receive buffers it holds, and :func:`emulation_problem` refuses a
rank count the machine's available memory cannot hold, with the number.
Activations are allocated and counted but never written, so they take address
space, not memory. Emulated ranks are not pinned to cores: they wait rather
than compute, and the scheduler spreads their message handling over every core.

What emulation measures: the runtime's order, deadlock freedom, message
traffic, per-action and per-message overhead, and the control plane; never
kernels. Every result says so (``RunResult.emulated``, the ``compute`` label of
written timelines, the CLI's line). Not emulated yet: meshes (dp, tp, cp or ep
> 1: their collectives), loaded weights, checkpoints and data (refused, named).
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from octopipe.execute.devices import is_gpu
from octopipe.execute.runs import ABORT_KEY, ActionRecord, RunOptions, StepEvents, WorkerConfig
from octopipe.execute.runtime.comm import BufferSpec, Channels, channel_groups, program_channels
from octopipe.execute.runtime.interpreter import RankRuntime, StageRunner
from octopipe.ir import ActionKind, Program, compile_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, local_cost_model
from octopipe.transform import BackwardKind, Device, ForwardContext, OverlapResult, WeightContext

__all__ = [
    "EMULATED_RANK_BYTES",
    "EmulatedMultiplexer",
    "EmulatedStage",
    "emulated_stages",
    "emulation_problem",
    "run_emulated_plan",
]

#: resident bytes of one emulated rank process before any message buffer: the interpreter, torch and gloo
#: (measured 328-330 MiB per rank on 4 emulated ranks, 2026-12-03; kept with a margin for gloo's buffers); used to
#: refuse rank counts memory cannot hold
EMULATED_RANK_BYTES = 450 * 2**20

#: the share of the machine's available memory emulated ranks may plan to take
_MEMORY_SHARE = 0.8


#: prctl's option for a thread's timer slack (linux/prctl.h)
_PR_SET_TIMERSLACK = 29


def _bytes(count: int) -> torch.Tensor:
    """A tensor of ``count`` bytes (at least one: gloo sends no empty message), never written: address space,
    not memory, until something writes it."""
    return torch.empty(max(1, count), dtype=torch.uint8)


def tighten_timer_slack() -> bool:
    """Ask Linux to wake this thread's sleeps within 1 ns of their deadline (``PR_SET_TIMERSLACK``) instead of
    the default 50 us slack, so an emulated computation ends when its profiled time has passed, not a
    slack later (measured here: a 1 ms sleep overshot by 102 us at the median with the default, 54 us with
    1 ns). Sleeping still takes no core. Returns whether the kernel took it (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _wait_until(deadline_ns: int) -> None:
    """Sleep (taking no core) until the host clock reaches ``deadline_ns``; a wake-up early sleeps again."""
    while True:
        left = deadline_ns - time.perf_counter_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)


@dataclass(frozen=True, slots=True)
class EmulatedLayout:
    """An emulated stage's boundary: one tensor in (plus the targets on the last stage), one out."""

    num_inputs: int
    input_requires_grad: tuple[bool, ...]
    num_outputs: int = 1
    output_requires_grad: tuple[bool, ...] = (True,)
    param_names: tuple[str, ...] = ()

    @property
    def num_params(self) -> int:
        return 0


@dataclass(eq=False)
class EmulatedStage:
    """One stage whose computations allocate what the profile says and wait for the profiled time.

    ``durations_us`` holds F, I, W and B (the simulator's ``CostModel.duration_us``); F saves
    ``activation_bytes``, I frees ``freed_by_input_bytes`` of them and keeps ``kept_for_weight_bytes`` for
    W, which frees the rest; B frees them all. The stage sends ``output_bytes`` forward and
    ``input_bytes`` (the previous stage's output) back. The last stage returns a zero loss."""

    stage: int
    first: bool
    last: bool
    durations_us: Mapping[ActionKind, float]
    activation_bytes: int
    freed_by_input_bytes: int
    kept_for_weight_bytes: int
    output_bytes: int
    input_bytes: int
    params: list[torch.Tensor] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    graphs: EmulatedLayout = field(init=False)

    def __post_init__(self) -> None:
        grads = (not self.first,) + ((False,) if self.last else ())
        self.graphs = EmulatedLayout(num_inputs=len(grads), input_requires_grad=grads)

    def wait(self, kind: ActionKind, started_ns: int | None = None) -> None:
        """Wait until ``kind``'s profiled duration has passed since ``started_ns`` (default: now)."""
        start = time.perf_counter_ns() if started_ns is None else started_ns
        _wait_until(start + round(self.durations_us[kind] * 1e3))

    def _input_grads(self) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = [None if self.first else _bytes(self.input_bytes)]
        return grads + ([None] if self.last else [])

    def _forward(self) -> tuple[list[torch.Tensor], ForwardContext]:
        output = torch.zeros(()) if self.last else _bytes(self.output_bytes)
        return [output], ForwardContext([_bytes(self.activation_bytes)])

    def _backward_input(self, ctx: ForwardContext) -> tuple[list[torch.Tensor | None], WeightContext]:
        ctx.saved = None
        kept = self.activation_bytes - self.freed_by_input_bytes + self.kept_for_weight_bytes
        return self._input_grads(), WeightContext([_bytes(kept)])

    def forward_all(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardContext]:
        start = time.perf_counter_ns()
        result = self._forward()
        self.wait(ActionKind.FORWARD, start)
        return result

    def backward_input_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], WeightContext]:
        start = time.perf_counter_ns()
        result = self._backward_input(ctx)
        self.wait(ActionKind.BACKWARD_INPUT, start)
        return result

    def full_backward_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        start = time.perf_counter_ns()
        ctx.saved = None
        grads = self._input_grads()
        self.wait(ActionKind.FULL_BACKWARD, start)
        return grads, []

    def backward_weight(self, ctx: WeightContext) -> list[torch.Tensor | None]:
        start = time.perf_counter_ns()
        ctx.tensors = None
        self.wait(ActionKind.BACKWARD_WEIGHT, start)
        return []


@dataclass(eq=False)
class _EmulatedOverlap:
    """An OVERLAP_F_B unit of two emulated stages: both halves' effects, one wait of the unit's duration."""

    forward: EmulatedStage
    backward: EmulatedStage
    kind: BackwardKind
    duration_us: float

    def run(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext, grad: torch.Tensor) -> OverlapResult:
        start = time.perf_counter_ns()
        (output,), forward_ctx = self.forward._forward()
        param_grads: list[torch.Tensor | None] | None
        if self.kind == "full":
            ctx.saved = None
            input_grads, weight_ctx, param_grads = self.backward._input_grads(), None, []
        else:
            (input_grads, weight_ctx), param_grads = self.backward._backward_input(ctx), None
        _wait_until(start + round(self.duration_us * 1e3))
        return OverlapResult(output, forward_ctx, input_grads, weight_ctx, param_grads)


@dataclass(eq=False)
class EmulatedMultiplexer:
    """Makes the OVERLAP_F_B units of emulated stages, timed as the simulator times them (``overlap_us``)."""

    costs: CostModel

    def multiplexed(
        self, forward: object, backward: object, split: object, kind: BackwardKind, *, stages: tuple[int, int]
    ) -> object:
        return None  # nothing to merge: an emulated unit is one wait

    def overlap(self, forward: EmulatedStage, backward: EmulatedStage, kind: BackwardKind) -> _EmulatedOverlap:
        backward_kind = ActionKind.FULL_BACKWARD if kind == "full" else ActionKind.BACKWARD_INPUT
        duration = self.costs.overlap_us(forward.stage, backward.stage, backward_kind)
        return _EmulatedOverlap(forward, backward, kind, duration)


_KINDS = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD)


def emulated_stages(program: Program, costs: CostModel, rank: int) -> dict[int, EmulatedStage]:
    """The emulated stages pipeline rank ``rank`` runs, costed as the simulator costs them."""
    last = program.num_stages - 1
    stages = {}
    for stage, holder in enumerate(program.placement):
        if holder != rank:
            continue
        cost = costs.stages[stage]
        stages[stage] = EmulatedStage(
            stage=stage,
            first=stage == 0,
            last=stage == last,
            durations_us={kind: costs.duration_us(stage, kind) for kind in _KINDS},
            activation_bytes=cost.activation_bytes,
            freed_by_input_bytes=cost.freed_by_backward_input_bytes,
            kept_for_weight_bytes=cost.kept_for_weight_bytes,
            output_bytes=cost.output_bytes,
            input_bytes=costs.stages[stage - 1].output_bytes if stage > 0 else 0,
        )
    return stages


def _received_bytes(program: Program, costs: CostModel) -> list[int]:
    """Per rank: the bytes of every message it receives in a step (an upper bound of what its receive
    buffers hold at once, which is what an emulated rank writes to memory)."""
    received = [0] * program.num_ranks
    for transfer, stage in enumerate(program.boundary_stage):
        received[program.receiver[transfer][0]] += max(1, costs.stages[stage].output_bytes)
    return received


def available_memory_bytes() -> int:
    """The machine's available memory (``MemAvailable`` of /proc/meminfo; 0 where unknown)."""
    try:
        text = open("/proc/meminfo", encoding="ascii").read()  # noqa: SIM115
    except OSError:
        return 0
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def emulation_problem(
    plans: Sequence[plan_pb2.Plan],
    profile: profile_pb2.Profile,
    options: RunOptions,
    available_bytes: int | None = None,
) -> str:
    """Why these plans cannot run emulated from ``profile`` on this machine ('' when they can): a mesh,
    options emulation does not take, a layer the profile lacks, or more ranks than memory holds (with the
    number that fits). ``available_bytes``: the memory to plan with (default: ``MemAvailable``)."""
    for plan in plans:
        mesh = plan.mesh if plan.HasField("mesh") else None
        if mesh is not None and max(mesh.dp, mesh.tp, mesh.cp, mesh.ep, 1) > 1:
            return (
                f"plan {plan.name!r}: emulation runs pipeline parallelism only (mesh dp {mesh.dp or 1}, "
                f"tp {mesh.tp or 1}, cp {mesh.cp or 1}, ep {mesh.ep or 1}); its collectives are not emulated yet"
            )
    unsupported = [
        name
        for name, given in (
            ("device", is_gpu(options.device)),
            ("weights", options.weights is not None),
            ("data", options.data is not None),
            ("checkpoints", bool(options.checkpoint_every or options.resume)),
            ("measure_memory", options.measure_memory),
            ("keep_grads", options.keep_grads),
            ("keep_params", options.keep_params),
        )
        if given
    ]
    if unsupported:
        return f"emulated runs compute nothing, so they take no {', '.join(unsupported)}: leave them out"
    world = max(len(plan.ranks) for plan in plans)
    heaviest = 0
    for plan in plans:
        missing = sorted(
            {n for stage in plan.stages for n in stage.layer_names} - {layer.layer_name for layer in profile.layers}
        )
        if missing:
            return f"the emulation profile has no cost for layer(s) {', '.join(missing[:5])} of plan {plan.name!r}"
        try:
            costs = local_cost_model(plan, profile)
        except (KeyError, ValueError) as exc:
            return f"plan {plan.name!r} cannot be costed from the emulation profile: {exc}"
        heaviest = max(heaviest, sum(_received_bytes(compile_plan(plan), costs)))
    available = available_memory_bytes() if available_bytes is None else available_bytes
    need = world * EMULATED_RANK_BYTES + heaviest
    if available and need > _MEMORY_SHARE * available:
        fits = max(0, int((_MEMORY_SHARE * available - heaviest) // EMULATED_RANK_BYTES))
        return (
            f"emulating {world} ranks needs about {need / 2**30:.1f} GiB ({world} x "
            f"{EMULATED_RANK_BYTES / 2**20:.0f} MiB per rank process + {heaviest / 2**20:.0f} MiB of messages per "
            f"step), more than {_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available here: "
            f"at most {fits} ranks fit"
        )
    return ""


def _buffer_spec(program: Program, costs: CostModel) -> Callable[[int], list[BufferSpec]]:
    sizes = [max(1, costs.stages[stage].output_bytes) for stage in program.boundary_stage]
    return lambda transfer: [(torch.Size([sizes[transfer]]), torch.uint8)]


def run_emulated_plan(
    config: WorkerConfig,
    plan: plan_pb2.Plan,
    store: dist.TCPStore,
    device: Device,
    plan_index: int,
    events: StepEvents | None = None,
) -> dict[str, object]:
    """Run ``plan``'s program on this rank for ``config.steps`` steps with emulated stages; return the
    worker's result entry (``emulated``: True; no gradients or parameters: nothing was computed).
    Each completed step's timeline also goes to ``events``, as in a real run."""
    profile = profile_pb2.Profile.FromString(config.emulate)
    costs = local_cost_model(plan, profile)
    program = compile_plan(plan)
    rank = config.rank
    tighten_timer_slack()  # this thread runs the program: its emulated computations sleep

    def aborted() -> str | None:
        return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None

    groups = channel_groups(program_channels(program))  # collective: one group per direction, every rank
    channels = Channels(
        program=program,
        rank=rank,
        groups=groups,
        buffer_spec=_buffer_spec(program, costs),
        timeout_s=config.timeout_s,
        aborted=aborted,
        device=device,
    )
    stages: dict[int, StageRunner] = dict(emulated_stages(program, costs, rank))
    runtime = RankRuntime(
        rank=rank, program=program, stages=stages, channels=channels, compiler=EmulatedMultiplexer(costs)
    )
    # the first stage's inputs and the last stage's targets: nothing reads them
    microbatches = [(torch.zeros(1), torch.zeros(1)) for _ in range(program.num_microbatches)]
    timelines: list[dict[str, object]] = []
    losses: list[float] = []
    for step in range(config.start_step, config.start_step + config.steps):
        records: list[ActionRecord] = []
        dist.barrier()  # ranks start each step together, so timelines line up (the group's timeout applies)
        watch = device.stopwatch()
        watch.mark()
        loss = runtime.run_step(step, microbatches, on_action=records.append, stopwatch=watch)
        watch.mark()
        if loss is not None:
            losses.append(float(loss))
        timeline = runtime.timeline(step, watch, records, loss)
        timelines.append(timeline.as_dict())
        if events is not None:
            events.put(timeline)
    runtime.close()
    return {
        "emulated": True,
        "memory": None,
        "param_bytes": 0,
        "flops_per_step": None,
        "plan": plan_index,
        "rank": rank,
        "stage_backends": {},
        "numerics": None,
        "tied_grads": {},
        "tied_params": {},
        "losses": losses,
        "grad_norms": [],
        "grads": {},
        "params": {},
        "timelines": timelines,
        "channels": {f"{d} {peer}": list(order) for (d, peer), order in runtime.channels.started.items()},
    }
