"""The interpreter: runs one rank's actions for one training step.

It owns the rank's stages (captured and split), their gradient accumulators
and the per-step state (stage inputs, contexts between F, B and W, tensors to
send). Neighbouring stages on the same rank hand tensors over directly. The
last stage's loss is scaled by 1/m through the output gradient it starts the
backward with, so accumulated gradients are those of the mean loss.

A stage given as a :class:`ShardedStage` (its parameters sharded over a
data-parallel group, see :mod:`octopipe.execute.runtime.mesh`) has no
parameters to compute with until its UNSHARD action gathers them, every step;
RESHARD drops the gathered parameters; REDUCE_GRAD turns the full gradients
accumulated so far into this rank's shard gradients, once per step, after the
stage's last backward. A plan that computes on a sharded stage before its
UNSHARD, accumulates after its REDUCE_GRAD, or never reduces is refused with an
error naming the action to add
(:func:`octopipe.execute.runtime.fsdp_actions.check_sharded_programs` finds the
same mistakes before any process starts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from octopipe.capture import StageGraphs
from octopipe.execute.runtime.comm import P2P
from octopipe.ir import Action, ActionKind
from octopipe.transform import ForwardContext, OverlapStage, StageExecutable, WeightContext, storage_bytes

__all__ = ["ActionRecord", "RankRuntime", "ShardedStage", "StepFailure", "rss_bytes"]


class ShardedStage(Protocol):
    """A stage whose parameters are sharded: UNSHARD gathers them, REDUCE_GRAD reduces full gradients to shards."""

    @property
    def graphs(self) -> StageGraphs:
        """The stage graphs (full parameters in, full gradients out); ``param_names`` name the shards too."""
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


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _stream(kind: ActionKind) -> str:
    """The stream a record names: compute, collective (UNSHARD, RESHARD, REDUCE_GRAD), send or recv."""
    if kind.is_compute:
        return "compute"
    if kind.is_collective:
        return "collective"
    return "send" if kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "recv"


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran: times on the machine's monotonic clock (comparable across local ranks)."""

    action: str
    stream: str
    start_ns: int
    end_ns: int
    #: bytes of activations, gradients in flight and messages this rank's program holds after the action
    held_bytes: int
    #: the process's resident set size after the action
    rss_bytes: int


@dataclass
class _StepState:
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    forward_ctx: dict[tuple[int, int], ForwardContext] = field(default_factory=dict)
    weight_ctx: dict[tuple[int, int], WeightContext] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    output_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)

    def held_bytes(self) -> int:
        """Bytes of the distinct storages this step's state holds (parameters excluded: they are not here).

        A context's bytes are counted once, when it is first seen, so recording
        costs little per action; tensors shared between two contexts count twice.
        """
        loose: list[object] = [*self.inputs.values(), *self.outputs.values(), *self.input_grads.values()]
        loose += [t for t in self.output_grads.values() if t.dim() > 0]
        total = storage_bytes(loose, exclude=self.static)
        live: dict[int, int] = {}
        for ctx in self.forward_ctx.values():
            live[id(ctx)] = self.sizes.get(id(ctx)) or storage_bytes(ctx.saved or [], exclude=self.static)
        for wctx in self.weight_ctx.values():
            if wctx.tensors is not None:
                live[id(wctx)] = self.sizes.get(id(wctx)) or storage_bytes(wctx.tensors, exclude=self.static)
        self.sizes = live
        return total + sum(live.values())

    static: list[torch.Tensor] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)


class RankRuntime:
    """One rank's stages and the interpreter of its program."""

    def __init__(
        self,
        *,
        rank: int,
        program: list[Action],
        stages: Mapping[int, StageExecutable | ShardedStage],
        stage_rank: dict[int, int],
        num_microbatches: int,
        p2p: P2P,
    ) -> None:
        self.rank = rank
        self.program = program
        #: stages ready to compute: plain ones always, sharded ones between UNSHARD and RESHARD
        self.stages: dict[int, StageExecutable] = {s: e for s, e in stages.items() if isinstance(e, StageExecutable)}
        self.sharded: dict[int, ShardedStage] = {s: e for s, e in stages.items() if not isinstance(e, StageExecutable)}
        self.stage_rank = stage_rank
        self.num_stages = max(stage_rank) + 1
        self.m = num_microbatches
        self.p2p = p2p
        self.num_params = {s: e.graphs.num_params for s, e in stages.items()}
        self.grads: dict[int, list[torch.Tensor | None]] = {s: [None] * n for s, n in self.num_params.items()}
        self.loss_scale = torch.ones(()) / num_microbatches
        self.static: list[torch.Tensor] = []
        self._restatic()
        self._overlaps: dict[tuple[int, int, ActionKind], tuple[StageExecutable, StageExecutable, OverlapStage]] = {}
        self._reduced: set[int] = set()
        self._resharded: set[int] = set()

    def _restatic(self) -> None:
        """Parameters, shards and buffers: excluded from ``held_bytes`` (updated in place; step states share it)."""
        tensors = [t for exe in self.stages.values() for t in (*exe.params, *exe.buffers)]
        tensors += [t for stage in self.sharded.values() for t in stage.static_tensors]
        self.static[:] = tensors

    def zero_grads(self) -> None:
        for stage in self.grads:
            self.grads[stage] = [None] * self.num_params[stage]

    def _exe(self, stage: int) -> StageExecutable:
        exe = self.stages.get(stage)
        if exe is not None:
            return exe
        if stage in self.sharded:
            why = "RESHARD dropped its gathered parameters" if stage in self._resharded else "no UNSHARD ran this step"
            raise RuntimeError(
                f"stage {stage} is sharded over its data-parallel group and {why}: put '{stage}UNSHARD' "
                f"before this action in rank {self.rank}'s program"
            )
        raise RuntimeError(f"stage {stage} is not on rank {self.rank}")

    def _accumulate(self, stage: int, grads: list[torch.Tensor | None]) -> None:
        if stage in self._reduced:
            raise RuntimeError(
                f"a backward of stage {stage} runs after its REDUCE_GRAD: move '{stage}REDUCE_GRAD' after the "
                "stage's last W (or B) in the program"
            )
        acc = self.grads[stage]
        for index, grad in enumerate(grads):
            if grad is None:
                continue
            acc[index] = grad if acc[index] is None else acc[index] + grad  # type: ignore[operator]

    def run_step(
        self,
        step: int,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        on_action: Callable[[ActionRecord], None] | None = None,
    ) -> torch.Tensor | None:
        """Run the program once; return the mean loss if this rank holds the last stage."""
        state = _StepState(static=self.static)
        for stage in self.sharded:  # last step's gathered parameters are stale after the optimizer step
            self._drop_gathered(stage)
        self._reduced.clear()
        self._resharded.clear()
        self._restatic()
        self.p2p.post_receives()
        for index, action in enumerate(self.program):
            start = time.perf_counter_ns()
            try:
                self._run(action, state, microbatches, step)
                if on_action is not None:
                    end = time.perf_counter_ns()
                    stream = _stream(action.kind)
                    on_action(ActionRecord(str(action), stream, start, end, state.held_bytes(), rss_bytes()))
            except Exception as exc:
                raise StepFailure(f"rank {self.rank}, step {step}, action {index} ({action}): {exc}") from exc
        self.p2p.finish_sends(f"rank {self.rank}, step {step}, end of step")
        leftovers = [k for k, c in state.weight_ctx.items() if c.tensors is not None]
        if leftovers:
            raise StepFailure(
                f"rank {self.rank}, step {step}: W never ran for (stage, micro-batch) {sorted(leftovers)}"
            )
        unreduced = [s for s in self.sharded if s not in self._reduced]
        if unreduced:
            raise StepFailure(
                f"rank {self.rank}, step {step}: sharded stages {unreduced} never ran REDUCE_GRAD; put "
                f"'<stage>REDUCE_GRAD' after each one's last W (or B) in rank {self.rank}'s program"
            )
        if state.losses:
            return torch.stack(state.losses).sum() * self.loss_scale
        return None

    def _stage_input(
        self, state: _StepState, stage: int, mb: int, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        if stage == 0:
            x = microbatches[mb][0]
        elif (stage, mb) in state.inputs:
            x = state.inputs.pop((stage, mb))
        elif self.stage_rank[stage - 1] == self.rank and (stage - 1, mb) in state.outputs:
            x = state.outputs.pop((stage - 1, mb))
        else:
            raise RuntimeError(
                f"the input of stage {stage}, micro-batch {mb} is not here: no RECV_F or same-rank forward produced it"
            )
        return [x, microbatches[mb][1]] if stage == self.num_stages - 1 else [x]

    def _output_grad(self, state: _StepState, stage: int, mb: int) -> torch.Tensor:
        if (stage, mb) in state.output_grads:
            return state.output_grads.pop((stage, mb))
        if self.stage_rank.get(stage + 1) == self.rank and (stage + 1, mb) in state.input_grads:
            return state.input_grads.pop((stage + 1, mb))
        raise RuntimeError(
            f"the output gradient of stage {stage}, micro-batch {mb} is not here: no RECV_B or same-rank backward produced it"
        )

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
            overlap = OverlapStage(exe_f, exe_b, backward="full" if full else "input")
            self._overlaps[key] = (exe_f, exe_b, overlap)
        inputs = self._stage_input(state, forward.stage, forward.microbatch, microbatches)
        bkey = (backward.stage, backward.microbatch)
        ctx = state.forward_ctx.pop(bkey)
        grad = self._output_grad(state, backward.stage, backward.microbatch)
        result = overlap.run(inputs, ctx, grad)
        self._forward_done(state, forward.stage, forward.microbatch, result.output, result.forward_ctx)
        if result.param_grads is not None:
            self._accumulate(backward.stage, result.param_grads)
        if result.weight_ctx is not None:
            state.weight_ctx[bkey] = result.weight_ctx
        if backward.stage > 0:
            assert result.input_grads[0] is not None
            state.input_grads[bkey] = result.input_grads[0]

    def _forward_done(self, state: _StepState, s: int, mb: int, out: torch.Tensor, ctx: ForwardContext) -> None:
        state.forward_ctx[(s, mb)] = ctx
        if s == self.num_stages - 1:
            state.losses.append(out)
            state.output_grads[(s, mb)] = self.loss_scale
        else:
            state.outputs[(s, mb)] = out

    def _run(
        self, action: Action, state: _StepState, microbatches: list[tuple[torch.Tensor, torch.Tensor]], step: int
    ) -> None:
        kind, s, mb = action.kind, action.stage, action.microbatch
        if kind is ActionKind.OVERLAP_F_B:
            self._overlap(action, state, microbatches)
            return
        if kind in (ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD):
            self._collective(kind, s)
            return
        assert mb is not None
        key = (s, mb)
        if kind is ActionKind.FORWARD:
            exe = self._exe(s)
            out, ctx = exe.forward(self._stage_input(state, s, mb, microbatches))
            self._forward_done(state, s, mb, out, ctx)
        elif kind in (ActionKind.BACKWARD_INPUT, ActionKind.FULL_BACKWARD):
            exe = self._exe(s)
            ctx = state.forward_ctx.pop(key)
            grad = self._output_grad(state, s, mb)
            if kind is ActionKind.FULL_BACKWARD:
                input_grads, param_grads = exe.full_backward(ctx, grad)
                self._accumulate(s, param_grads)
            else:
                input_grads, state.weight_ctx[key] = exe.backward_input(ctx, grad)
            if s > 0:
                assert input_grads[0] is not None
                state.input_grads[key] = input_grads[0]
        elif kind is ActionKind.BACKWARD_WEIGHT:
            wctx = state.weight_ctx.get(key)
            if wctx is None:
                raise RuntimeError(f"W of stage {s}, micro-batch {mb} runs before its B (I)")
            self._accumulate(s, self._exe(s).backward_weight(wctx))
        elif kind is ActionKind.SEND_F:
            self.p2p.send(action, state.outputs.pop(key), self.stage_rank[s + 1])
        elif kind is ActionKind.SEND_B:
            self.p2p.send(action, state.input_grads.pop(key), self.stage_rank[s - 1])
        elif kind is ActionKind.RECV_F:
            state.inputs[key] = self.p2p.receive(action, f"rank {self.rank}, step {step} ({action})")
        elif kind is ActionKind.RECV_B:
            state.output_grads[key] = self.p2p.receive(action, f"rank {self.rank}, step {step} ({action})")

    def _collective(self, kind: ActionKind, stage: int) -> None:
        """UNSHARD, RESHARD, REDUCE_GRAD; no-ops on a stage that is not sharded (dp = 1)."""
        sharded = self.sharded.get(stage)
        if sharded is None:
            return
        if kind is ActionKind.UNSHARD:
            if stage in self.stages:
                raise RuntimeError(f"stage {stage} is unsharded already: remove the second UNSHARD or RESHARD first")
            self.stages[stage] = sharded.unshard()
            self._resharded.discard(stage)
        elif kind is ActionKind.RESHARD:
            self._drop_gathered(stage)
            self._resharded.add(stage)
        else:
            if stage in self._reduced:
                raise RuntimeError(
                    f"stage {stage} ran REDUCE_GRAD twice in one step: keep one, after its last W (or B)"
                )
            self.grads[stage] = sharded.reduce_grad(self.grads[stage])
            self._reduced.add(stage)
        self._restatic()

    def _drop_gathered(self, stage: int) -> None:
        """Forget a sharded stage's gathered parameters (and multiplexed graphs bound to them), so they can be freed."""
        self.stages.pop(stage, None)
        for key in [k for k in self._overlaps if stage in k[:2]]:
            del self._overlaps[key]
