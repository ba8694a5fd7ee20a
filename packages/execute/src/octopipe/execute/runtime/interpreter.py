"""The interpreter: runs one rank's part of a compiled program for one training step.

It runs the :class:`~octopipe.ir.program.Program` that the simulator timed and
the verifier checked, action by action, and keeps only tensors: the rank's
stages (captured and split), their gradient accumulators and the per-step
state (stage inputs, contexts between F, B and W, tensors to send). What an
action means is the program's: a RECV posts its receive, the computation that
consumes the data waits for it (``Program.waits``), a SEND starts its send,
every send completes by the end of the step (:class:`~octopipe.execute.runtime.comm.Channels`,
strict order per channel). Neighbouring stages on the same rank hand tensors
over directly. The last stage's loss is scaled by 1/m through the output
gradient it starts the backward with, so accumulated gradients are those of
the mean loss.

A stage's boundary is a list of tensors: one for a layer-list stage, several
for a whole-model graph stage (hidden states, router logits, ...). A SEND_F
carries all of a stage's outputs, a SEND_B the gradients of those that carry
one (``output_requires_grad``). Parameters named in ``per_microbatch``
(tied weights, summed across ranks by the worker) keep one gradient per
micro-batch in ``microbatch_grads`` instead of the running sum.

A stage given as a :class:`ShardedStage` (its parameters sharded over a
data-parallel group, see :mod:`octopipe.execute.runtime.mesh`) has no
parameters to compute with until its UNSHARD action gathers them, every step;
RESHARD drops the gathered parameters; REDUCE_GRAD turns the full gradients
accumulated so far into this rank's shard gradients, once per step, after the
stage's last backward. UNSHARD and REDUCE_GRAD run on the rank's collective
stream (:class:`~octopipe.execute.runtime.collective_stream.CollectiveStream`),
as the program says: posted where they stand, in order, beside the compute; the
first computation of a stage waits for its UNSHARD, and the step ends when
every REDUCE_GRAD has completed. That every computation has its input, its
UNSHARD and its place before REDUCE_GRAD is guaranteed by the program
compiler; here those are assertions, not checks.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from octopipe.capture import StageGraphs
from octopipe.execute.runs import ActionRecord, StepTimeline
from octopipe.execute.runtime.collective_stream import CollectiveStream, CollectiveTimes, Pending, collective_records
from octopipe.execute.runtime.comm import Channels
from octopipe.execute.runtime.precision import GRAD_DTYPE
from octopipe.ir import Action, ActionKind
from octopipe.ir.program import OVERLAP, Program, stream_of
from octopipe.transform import (
    BackwardKind,
    BWSplit,
    ForwardContext,
    OverlapResult,
    StageCompiler,
    StageExecutable,
    Stopwatch,
    WeightContext,
    storage_bytes,
    storage_pointers,
)

__all__ = [
    "ActionRecord",
    "Multiplexer",
    "RankRuntime",
    "ShardedStage",
    "StageLayout",
    "StageRunner",
    "StepFailure",
    "minor_faults",
    "rss_bytes",
]


class StageLayout(Protocol):
    """What the interpreter reads of a stage's graphs: its boundary (``capture.StageGraphs`` has it)."""

    @property
    def num_inputs(self) -> int: ...
    @property
    def num_outputs(self) -> int: ...
    @property
    def input_requires_grad(self) -> tuple[bool, ...]: ...
    @property
    def output_requires_grad(self) -> tuple[bool, ...]: ...
    @property
    def num_params(self) -> int: ...


class StageRunner(Protocol):
    """A stage that holds its parameters, as the interpreter calls it: a captured
    :class:`~octopipe.transform.StageExecutable`, or an emulated stage
    (:mod:`octopipe.execute.runtime.emulate`) whose computations wait for their profiled durations."""

    @property
    def graphs(self) -> StageLayout: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def buffers(self) -> Sequence[torch.Tensor]: ...

    def forward_all(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardContext]: ...
    def backward_input_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], WeightContext]: ...
    def full_backward_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]: ...
    def backward_weight(self, ctx: WeightContext) -> list[torch.Tensor | None]: ...


class OverlapRunner(Protocol):
    """One OVERLAP_F_B unit, bound to its two stages (``transform.OverlapStage``)."""

    def run(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext, grad: torch.Tensor, /) -> OverlapResult: ...


class Multiplexer(Protocol):
    """What makes the OVERLAP_F_B units of a program: the stage compiler (``transform.StageCompiler``), or the
    emulated one. ``multiplexed`` is called once per pair before the first step, ``overlap`` at its first use."""

    def multiplexed(
        self, forward: Any, backward: Any, split: Any, kind: BackwardKind, *, stages: tuple[int, int]
    ) -> object: ...
    def overlap(self, forward: Any, backward: Any, kind: BackwardKind) -> OverlapRunner: ...


@runtime_checkable
class ShardedStage(Protocol):
    """A stage whose parameters are sharded: UNSHARD gathers them, REDUCE_GRAD reduces full gradients to shards."""

    @property
    def graphs(self) -> StageGraphs:
        """The stage graphs (full parameters in, full gradients out); ``param_names`` name the shards too."""
        ...

    @property
    def split(self) -> BWSplit:
        """The B/W split of ``graphs``' backward."""
        ...

    @property
    def static_tensors(self) -> list[torch.Tensor]:
        """Shards and buffers this stage always holds (not counted as activations)."""
        ...

    def unshard(self) -> StageExecutable:
        """UNSHARD (a collective): a stage bound to the gathered parameters."""
        ...

    def reduce_grad(self, full_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """REDUCE_GRAD (a collective): one shard gradient per parameter."""
        ...


class StepFailure(RuntimeError):
    """An action failed; the message names the rank, step and action."""


def minor_faults() -> int:
    """Minor page faults this process has taken so far (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unknown."""
    return _Resident().read()


class _Resident:
    """Reads this process's resident set size per action: ``/proc/self/statm`` opened once, read in place."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self.fd = None
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def read(self) -> int:
        if self.fd is None:
            return 0
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) * self.page
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


Grads = list[torch.Tensor | None]


@dataclass
class _StepState:
    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    forward_ctx: dict[tuple[int, int], ForwardContext] = field(default_factory=dict)
    weight_ctx: dict[tuple[int, int], WeightContext] = field(default_factory=dict)
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    #: one gradient (or None) per stage output
    output_grads: dict[tuple[int, int], Grads] = field(default_factory=dict)
    #: one gradient (or None) per boundary input of the stage (= per output of the stage before)
    input_grads: dict[tuple[int, int], Grads] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)

    def held_bytes(self) -> int:
        """Bytes of the distinct storages this step's state holds (parameters excluded: they are not here).

        A context's bytes are counted once, when it is first seen, so recording
        costs little per action; tensors shared between two contexts count twice.
        """
        loose: list[object] = [t for ts in (*self.inputs.values(), *self.outputs.values()) for t in ts]
        loose += [t for ts in self.input_grads.values() for t in ts if t is not None]
        loose += [t for ts in self.output_grads.values() for t in ts if t is not None and t.dim() > 0]
        total = storage_bytes(loose, exclude=self.static_pointers)
        live: dict[int, int] = {}
        for ctx in self.forward_ctx.values():
            live[id(ctx)] = self.sizes.get(id(ctx)) or storage_bytes(ctx.saved or [], exclude=self.static_pointers)
        for wctx in self.weight_ctx.values():
            if wctx.tensors is not None:
                live[id(wctx)] = self.sizes.get(id(wctx)) or storage_bytes(wctx.tensors, exclude=self.static_pointers)
        self.sizes = live
        return total + sum(live.values())

    #: the storages of parameters, shards and buffers (``RankRuntime._restatic`` keeps it current)
    static_pointers: set[int] = field(default_factory=set)
    sizes: dict[int, int] = field(default_factory=dict)


class RankRuntime:
    """One rank's stages and the interpreter of its program."""

    def __init__(
        self,
        *,
        rank: int,
        program: Program,
        stages: Mapping[int, StageRunner | ShardedStage],
        channels: Channels,
        per_microbatch: Mapping[int, Sequence[int]] | None = None,
        compiler: Multiplexer | None = None,
    ) -> None:
        self.rank = rank
        #: the compiler the stages came from; it multiplexes the OVERLAP_F_B pairs of the program
        self.compiler: Multiplexer = compiler or StageCompiler()
        #: the compiled program (all ranks); this rank runs ``actions``
        self.program = program
        self.actions: list[Action] = program.actions(rank)
        stage_rank = dict(enumerate(program.placement))
        num_microbatches = program.num_microbatches
        #: stages ready to compute: plain ones always, sharded ones between UNSHARD and RESHARD
        self.stages: dict[int, StageRunner] = {s: e for s, e in stages.items() if not isinstance(e, ShardedStage)}
        self.sharded: dict[int, ShardedStage] = {s: e for s, e in stages.items() if isinstance(e, ShardedStage)}
        self.stage_rank = stage_rank
        self.num_stages = max(stage_rank) + 1
        self.m = num_microbatches
        self.channels = channels
        self.num_params = {s: e.graphs.num_params for s, e in stages.items()}
        self.grads: dict[int, list[torch.Tensor | None]] = {s: [None] * n for s, n in self.num_params.items()}
        #: the last step's recorded actions: (start mark, end mark) indices on its stopwatch
        self.action_marks: list[tuple[int, int]] = []
        #: stage -> parameter indices whose gradients are kept per micro-batch (not summed here)
        self.per_microbatch = {s: frozenset(i) for s, i in (per_microbatch or {}).items()}
        #: (stage, parameter index) -> one gradient per micro-batch (None until its backward ran)
        self.microbatch_grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self.loss_scale = torch.ones(()) / num_microbatches
        self.static_pointers: set[int] = set()
        self._resident = _Resident()
        self._restatic()
        self.zero_grads()
        self._overlaps: dict[tuple[int, int, ActionKind], tuple[StageRunner, StageRunner, OverlapRunner]] = {}
        self._reduced: set[int] = set()
        #: the rank's collective stream (only with sharded stages), and what is posted on it and not yet waited for
        self.collectives = (
            CollectiveStream(timeout_s=channels.timeout_s, aborted=channels.aborted, device=channels.device)
            if self.sharded
            else None
        )
        self._gathering: dict[int, Pending[StageExecutable]] = {}
        self._reducing: dict[int, Pending[list[torch.Tensor | None]]] = {}
        self._posted: dict[int, Pending[object]] = {}
        #: the last step's collectives as they ran on the stream, by action index
        self.collective_times: dict[int, CollectiveTimes] = {}
        self._multiplex_pairs()

    def _multiplex_pairs(self) -> None:
        """Multiplex every (F stage, backward stage, kind) the program's OVERLAP_F_B actions name, now: the
        graphs exist before the first step (a sharded stage's too: they do not depend on its parameters)."""
        for action in self.actions:
            if action.kind is not ActionKind.OVERLAP_F_B:
                continue
            forward, backward = action.sub_actions
            kind: BackwardKind = "full" if backward.kind is ActionKind.FULL_BACKWARD else "input"
            self.compiler.multiplexed(
                self._graphs(forward.stage),
                self._graphs(backward.stage),
                self._split(backward.stage),
                kind,
                stages=(forward.stage, backward.stage),
            )

    def _restatic(self) -> None:
        """Parameters, shards and buffers: excluded from ``held_bytes`` (updated in place; step states share it)."""
        tensors = [t for exe in self.stages.values() for t in (*exe.params, *exe.buffers)]
        tensors += [t for stage in self.sharded.values() for t in stage.static_tensors]
        self.static_pointers.clear()
        self.static_pointers.update(storage_pointers(tensors))

    def zero_grads(self) -> None:
        for stage in self.grads:
            self.grads[stage] = [None] * self.num_params[stage]
        self.microbatch_grads = {
            (s, i): [None] * self.m for s, indices in self.per_microbatch.items() for i in sorted(indices)
        }

    def close(self) -> None:
        """Stop the channel and collective threads (after the last step, before the groups are destroyed)."""
        self.channels.close()
        if self.collectives is not None:
            self.collectives.close()
        self._resident.close()

    def _exe(self, stage: int) -> StageRunner:
        gathering = self._gathering.pop(stage, None)
        if gathering is not None:  # the stage's first computation since its UNSHARD: wait for the gather
            self.stages[stage] = gathering.wait(f"rank {self.rank}: stage {stage} waiting for its UNSHARD")
            self._restatic()
        exe = self.stages.get(stage)
        assert exe is not None, f"stage {stage} computes without its parameters (compile_plan requires its UNSHARD)"
        return exe

    def _accumulate(self, stage: int, grads: list[torch.Tensor | None], mb: int) -> None:
        assert stage not in self._reduced, f"a backward of stage {stage} after its REDUCE_GRAD"
        acc = self.grads[stage]
        kept = self.per_microbatch.get(stage, frozenset())
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            grad = grad.to(GRAD_DTYPE)  # float32 whatever the compute dtype (runtime.precision); float32: itself
            if index in kept:
                slot = self.microbatch_grads[(stage, index)]
                assert slot[mb] is None, f"stage {stage}, micro-batch {mb}: two weight gradients"
                slot[mb] = grad
                continue
            # in place: an out-of-place sum would hold a second copy of the largest gradient while every
            # new gradient of the backward is still alive, bytes the simulator does not count (same kernel,
            # same bits as ``acc + grad``)
            held = acc[index]
            if held is not None:
                held.add_(grad)
            elif any(g is not None and g.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
                     for g in acc):  # fmt: skip
                acc[index] = grad.clone()  # two gradients in one storage: adding into one must not change both
            else:
                acc[index] = grad

    def run_step(
        self,
        step: int,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        on_action: Callable[[ActionRecord], None] | None = None,
        stopwatch: Stopwatch | None = None,
    ) -> torch.Tensor | None:
        """Run the program once; return the mean loss if this rank holds the last stage.

        With ``on_action``, each action's record goes to it as the action returns, with host times;
        ``stopwatch`` (the device's, default a new one) marks each action's start and end, and
        ``action_marks`` lists the marks' indices per recorded action, to read the device's times after the
        step (:meth:`Stopwatch.device_ns`)."""
        watch = stopwatch if stopwatch is not None else self.channels.device.stopwatch()
        self.action_marks = []
        state = _StepState(static_pointers=self.static_pointers)
        for stage in self.sharded:  # last step's gathered parameters are stale after the optimizer step
            self._drop_gathered(stage)
        self._reduced.clear()
        self._posted = {}
        self._restatic()
        codes = self.program.codes[self.rank]
        for index, action in enumerate(self.actions):
            try:
                waited = time.perf_counter_ns() if on_action is not None else 0
                if codes[index] <= OVERLAP:  # a computation first waits for the transfers and gathers it consumes
                    for transfer in self.program.transfers_waited(self.rank, index):
                        self.channels.wait(transfer, f"rank {self.rank}, step {step} ({action})")
                    for part in action.computations:
                        if part.stage in self._gathering:
                            self._exe(part.stage)
                faults = minor_faults() if on_action is not None else 0
                start = watch.mark() if on_action is not None else 0  # the action's own work starts here
                self._run(index, action, state, microbatches)
                if on_action is not None:
                    end = watch.mark()
                    faults = minor_faults() - faults
                    self.action_marks.append((len(watch.host) - 2, len(watch.host) - 1))
                    stream = stream_of(codes[index])
                    held = state.held_bytes()
                    on_action(
                        ActionRecord(
                            str(action),
                            stream,
                            start,
                            end,
                            held,
                            self._resident.read(),
                            wait_ns=start - waited,
                            minor_faults=faults,
                        )
                    )
            except Exception as exc:
                raise StepFailure(f"rank {self.rank}, step {step}, action {index} ({action}): {exc}") from exc
        self.channels.finish(f"rank {self.rank}, step {step}, end of step")
        self._drain(step)
        # the program compiler guarantees both: every I has its W, every sharded stage its REDUCE_GRAD
        assert all(c.tensors is None for c in state.weight_ctx.values()), "a W never ran"
        assert all(s in self._reduced for s in self.sharded), "a sharded stage never ran REDUCE_GRAD"
        if state.losses:
            return torch.stack(state.losses).sum() * self.loss_scale
        return None

    def timeline(
        self,
        step: int,
        watch: Stopwatch,
        records: Sequence[ActionRecord],
        loss: torch.Tensor | None,
        *,
        rank: int | None = None,
        **fields: object,
    ) -> StepTimeline:
        """The last step's :class:`StepTimeline`: ``records`` (from ``run_step``'s ``on_action``) at the device's
        times of their marks on ``watch``, whose first and last marks are the step's start and end (the one wait
        for the device a step makes), collectives as they ran on their stream. ``rank``: the process's global rank
        (default: the pipeline rank); ``fields`` go to the timeline."""
        times = watch.device_ns()
        timed = tuple(
            replace(r, start_ns=times[a], end_ns=times[b], host_start_ns=r.start_ns, host_end_ns=r.end_ns)
            for r, (a, b) in zip(records, self.action_marks, strict=True)
        )
        return StepTimeline(
            rank=self.rank if rank is None else rank,
            step=step,
            start_ns=times[0],
            end_ns=times[-1],
            records=collective_records(timed, self.collective_times),
            loss=None if loss is None else float(loss),
            **fields,  # type: ignore[arg-type]
        )

    def _stage_input(
        self, state: _StepState, stage: int, mb: int, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        if stage == 0:
            values = [microbatches[mb][0]]
        elif (stage, mb) in state.inputs:
            values = state.inputs.pop((stage, mb))
        else:  # the previous stage on this rank produced it (compile_plan checked that it ran before)
            values = state.outputs.pop((stage - 1, mb))
        return [*values, microbatches[mb][1]] if stage == self.num_stages - 1 else list(values)

    def _output_grads(self, state: _StepState, stage: int, mb: int) -> Grads:
        if (stage, mb) in state.output_grads:
            return state.output_grads.pop((stage, mb))
        return state.input_grads.pop((stage + 1, mb))  # from the next stage on this rank (compile_plan checked it)

    def _received_grads(self, stage: int, received: list[torch.Tensor]) -> Grads:
        """A RECV_B's tensors, one per output that carries a gradient, as one gradient (or None) per output."""
        flags = self._graphs(stage).output_requires_grad
        assert sum(flags) == len(received), f"stage {stage}: {len(received)} gradients for {sum(flags)} outputs"
        values = iter(received)
        return [next(values) if needed else None for needed in flags]

    def _boundary_grads(self, stage: int, input_grads: Grads) -> Grads:
        """The input gradients that go to the stage before: one per boundary input (targets excluded)."""
        graphs = self._graphs(stage)
        count = graphs.num_inputs - (1 if stage == self.num_stages - 1 else 0)
        grads = list(input_grads[:count])
        for index, (grad, needed) in enumerate(zip(grads, graphs.input_requires_grad, strict=False)):
            if needed and grad is None:
                raise RuntimeError(
                    f"stage {stage}'s backward gives no gradient for its boundary input {index}, which carries one"
                )
        return grads

    def _sent_grads(self, stage: int, grads: Grads) -> list[torch.Tensor]:
        flags = self._graphs(stage).input_requires_grad
        return [g for g, needed in zip(grads, flags, strict=False) if needed and g is not None]

    def _graphs(self, stage: int) -> StageLayout:
        exe = self.stages.get(stage)
        return exe.graphs if exe is not None else self.sharded[stage].graphs

    def _split(self, stage: int) -> object:
        """The B/W split the multiplexer merges with the forward (an emulated stage has none)."""
        exe = self.stages.get(stage)
        return getattr(exe, "split", None) if exe is not None else self.sharded[stage].split

    def _overlap(
        self, action: Action, state: _StepState, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """OVERLAP_F_B: one micro-batch's F and another's B (or I) as one multiplexed graph."""
        forward, backward = action.sub_actions
        assert forward.microbatch is not None and backward.microbatch is not None
        key = (forward.stage, backward.stage, backward.kind)
        exe_f, exe_b = self._exe(forward.stage), self._exe(backward.stage)
        cached = self._overlaps.get(key)
        if cached is not None and cached[0] is exe_f and cached[1] is exe_b:
            overlap = cached[2]
        else:  # first use, or a sharded stage was gathered again (new parameter tensors)
            full = backward.kind is ActionKind.FULL_BACKWARD
            overlap = self.compiler.overlap(exe_f, exe_b, "full" if full else "input")
            self._overlaps[key] = (exe_f, exe_b, overlap)
        if exe_f.graphs.num_outputs != 1 or exe_b.graphs.num_outputs != 1:
            raise ValueError(
                f"{action}: OVERLAP_F_B runs stages with one boundary tensor only; stage "
                f"{forward.stage if exe_f.graphs.num_outputs != 1 else backward.stage} has several: "
                "use a plan without OVERLAP_F_B for this model"
            )
        inputs = self._stage_input(state, forward.stage, forward.microbatch, microbatches)
        bkey = (backward.stage, backward.microbatch)
        ctx = state.forward_ctx.pop(bkey)
        (grad,) = self._output_grads(state, backward.stage, backward.microbatch)
        assert grad is not None
        result = overlap.run(inputs, ctx, grad)
        self._forward_done(state, forward.stage, forward.microbatch, [result.output], result.forward_ctx)
        if result.param_grads is not None:
            self._accumulate(backward.stage, result.param_grads, backward.microbatch)
        if result.weight_ctx is not None:
            state.weight_ctx[bkey] = result.weight_ctx
        if backward.stage > 0:
            state.input_grads[bkey] = self._boundary_grads(backward.stage, result.input_grads)

    def _forward_done(
        self, state: _StepState, s: int, mb: int, outputs: list[torch.Tensor], ctx: ForwardContext
    ) -> None:
        state.forward_ctx[(s, mb)] = ctx
        if s == self.num_stages - 1:
            (loss,) = outputs
            state.losses.append(loss)
            # the seed of the backward on the loss's device (a CPU seed fails a CUDA nll_loss_backward), in its
            # dtype as autograd casts it for a bf16 loss
            state.output_grads[(s, mb)] = [self.loss_scale.to(device=loss.device, dtype=loss.dtype)]
        else:
            state.outputs[(s, mb)] = outputs

    def _run(
        self, index: int, action: Action, state: _StepState, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        kind, s, mb = action.kind, action.stage, action.microbatch
        if kind is ActionKind.OVERLAP_F_B:
            self._overlap(action, state, microbatches)
            return
        if kind in (ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD):
            self._collective(index, kind, s)
            return
        assert mb is not None
        key = (s, mb)
        if kind is ActionKind.FORWARD:
            exe = self._exe(s)
            outputs, ctx = exe.forward_all(self._stage_input(state, s, mb, microbatches))
            self._forward_done(state, s, mb, outputs, ctx)
        elif kind in (ActionKind.BACKWARD_INPUT, ActionKind.FULL_BACKWARD):
            exe = self._exe(s)
            ctx = state.forward_ctx.pop(key)
            grads = self._output_grads(state, s, mb)
            if kind is ActionKind.FULL_BACKWARD:
                input_grads, param_grads = exe.full_backward_all(ctx, grads)
                self._accumulate(s, param_grads, mb)
            else:
                input_grads, state.weight_ctx[key] = exe.backward_input_all(ctx, grads)
            if s > 0:
                state.input_grads[key] = self._boundary_grads(s, input_grads)
        elif kind is ActionKind.BACKWARD_WEIGHT:
            wctx = state.weight_ctx[key]  # its I ran before (compile_plan checked it)
            self._accumulate(s, self._exe(s).backward_weight(wctx), mb)
        elif kind is ActionKind.SEND_F:
            self.channels.send_all(self.program.transfer_of[self.rank][index], state.outputs.pop(key))
        elif kind is ActionKind.SEND_B:
            sent = self._sent_grads(s, state.input_grads.pop(key))
            self.channels.send_all(self.program.transfer_of[self.rank][index], sent)
        elif kind is ActionKind.RECV_F:  # posted now; the forward that consumes it waits for it
            state.inputs[key] = self.channels.post_recv_all(self.program.transfer_of[self.rank][index])
        elif kind is ActionKind.RECV_B:  # the next stage's gradients for this stage's outputs
            received = self.channels.post_recv_all(self.program.transfer_of[self.rank][index])
            state.output_grads[key] = self._received_grads(s, received)

    def _collective(self, index: int, kind: ActionKind, stage: int) -> None:
        """UNSHARD and REDUCE_GRAD are posted on the collective stream; RESHARD drops the gathered parameters.
        No-ops on a stage that is not sharded (dp = 1)."""
        sharded = self.sharded.get(stage)
        if sharded is None:
            return
        assert self.collectives is not None
        if kind is ActionKind.UNSHARD:
            assert stage not in self.stages and stage not in self._gathering, f"stage {stage} unsharded twice"
            self._gathering[stage] = self.collectives.submit(f"UNSHARD of stage {stage}", sharded.unshard)
            self._posted[index] = self._gathering[stage]  # type: ignore[assignment]
        elif kind is ActionKind.RESHARD:
            if stage in self._gathering:  # gathered for nothing: let the gather end before dropping it
                self._exe(stage)
            self._drop_gathered(stage)
        else:
            assert stage not in self._reduced, f"stage {stage} reduced twice"
            grads = self.grads[stage]  # nothing of the stage computes after its REDUCE_GRAD (compile_plan)
            self._reducing[stage] = self.collectives.submit(
                f"REDUCE_GRAD of stage {stage}", lambda: sharded.reduce_grad(grads)
            )
            self._posted[index] = self._reducing[stage]  # type: ignore[assignment]
            self._reduced.add(stage)
        self._restatic()

    def _drain(self, step: int) -> None:
        """The end of the step: every posted collective has completed; reduced gradients replace the full ones."""
        for stage in list(self._gathering):
            self._exe(stage)
        for stage, pending in sorted(self._reducing.items()):
            reduced = pending.wait(f"rank {self.rank}, step {step}, end of step")
            wrong = {str(g.dtype) for g in reduced if g is not None and g.dtype != GRAD_DTYPE}
            if wrong:  # mixed precision reduces in float32 (runtime.precision): never silently in bf16
                raise RuntimeError(f"stage {stage}'s gradients were reduced in {sorted(wrong)}, not float32")
            self.grads[stage] = reduced
        self._reducing.clear()
        self.collective_times = {index: pending.times for index, pending in self._posted.items()}

    def _drop_gathered(self, stage: int) -> None:
        """Forget a sharded stage's gathered parameters (and multiplexed graphs bound to them), so they can be freed."""
        self.stages.pop(stage, None)
        self._gathering.pop(stage, None)
        for key in [k for k in self._overlaps if stage in k[:2]]:
            del self._overlaps[key]
