"""A rank's stages from the model's own forward: whole-model capture, the launch guard, tied gradients.

``whole_model_stages`` records the model's training forward as one graph
(``octopipe.capture.trace_model``) on the first micro-batch and cuts it at the
plan's layer boundaries (``split_graph``); a stage boundary may carry several
tensors (hidden states, router logits), some without a gradient.

``guard`` is the numerics check at launch: each rank runs its own stages as
the runtime does (the captured graphs), the other stages as written, and
``check_numerics`` refuses to train, naming the stage, if an output or the
loss differs from the model's own ops.

``guard_stages`` is the same check for a model loaded stage by stage (no rank holds every weight): each
rank compares its stages with their own ops on the boundary values the previous stages' holders computed
and passed on; the whole-model loss comparison, which needs every weight in one process, is not made.

``reduce_tied`` sums a tied parameter's gradients (tied input/output
embeddings) across the stages that hold a copy, before the optimizer step,
so every copy gets the same gradient and stays bitwise equal after the
update. It is the model's own sum: per micro-batch, the uses' partial
gradients in the order eager autograd adds them (later stages first), then
over micro-batches in order -- exactly what ``loss.backward()`` accumulates
into the one shared tensor. Each holder broadcasts its per-micro-batch
partials (one broadcast per use, over the whole group), so every rank adds
the same tensors in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from octopipe.capture import (
    GraphStage,
    ModelGraph,
    NumericsReport,
    StageModule,
    TiedParameter,
    check_numerics,
    compare_outputs,
    split_graph,
    tied_parameters,
    trace_model,
)
from octopipe.execute.runtime.comm import BufferSpec
from octopipe.execute.runtime.interpreter import RankRuntime
from octopipe.execute.runtime.models import model_inputs
from octopipe.ir.program import SEND_F, Program
from octopipe.transform import StageExecutable

__all__ = [
    "Boundaries",
    "WholeModelStages",
    "buffer_specs",
    "graph_boundaries",
    "guard",
    "guard_stages",
    "layer_boundaries",
    "reduce_tied",
    "tied_indices",
    "whole_model_stages",
]


@dataclass(frozen=True, eq=False)
class WholeModelStages:
    """The captured model, its stages, and each stage's example inputs (boundary values, then the target)."""

    graph: ModelGraph
    stages: list[GraphStage]
    examples: list[list[torch.Tensor]]
    ties: list[TiedParameter]


@dataclass(frozen=True, eq=False)
class Boundaries:
    """Per stage (but the last): an example of each output, and which outputs carry a gradient."""

    outputs: Mapping[int, Sequence[torch.Tensor]]
    requires_grad: Mapping[int, Sequence[bool]]


def whole_model_stages(
    model: nn.Module,
    names: tuple[str, str],
    microbatch: tuple[torch.Tensor, torch.Tensor],
    partition: Sequence[Sequence[str]] | None = None,
) -> WholeModelStages:
    """Capture ``model(**{names[0]: inputs, names[1]: targets})`` once and split it at ``partition``
    (None: one stage per layer, as the profiler times them)."""
    inputs = model_inputs(names, *microbatch)
    graph = trace_model(model, inputs, targets=[names[1]])
    if partition is None:
        partition = [[layer] for layer in graph.layers]
    stages = split_graph(graph, partition, allow_tied=True)
    values = [inputs[n] for n in stages[0].boundary_names]
    examples = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for stage in stages:
            if stage.is_last:
                values = [*values, inputs[names[1]]]
            examples.append(values)
            out = stage(*values)
            values = [out] if isinstance(out, torch.Tensor) else list(out)
    return WholeModelStages(graph=graph, stages=stages, examples=examples, ties=tied_parameters(stages))


def layer_boundaries(stages: Sequence[StageModule], activations: Sequence[torch.Tensor]) -> Boundaries:
    """A layer-list model's boundaries: one tensor each, with a gradient."""
    return Boundaries(
        outputs={s: [activations[s + 1]] for s in range(len(stages) - 1)},
        requires_grad={s: [True] for s in range(len(stages) - 1)},
    )


def graph_boundaries(whole: WholeModelStages) -> Boundaries:
    stages = whole.stages
    return Boundaries(
        outputs={s: whole.examples[s + 1][: len(stages[s].output_names)] for s in range(len(stages) - 1)},
        requires_grad={s: stages[s].output_requires_grad for s in range(len(stages) - 1)},
    )


def buffer_specs(program: Program, boundaries: Boundaries) -> Callable[[int], list[BufferSpec]]:
    """The receive buffers of a transfer: the boundary stage's outputs (F) or those that carry a gradient (B)."""

    def spec(transfer: int) -> list[BufferSpec]:
        stage = program.boundary_stage[transfer]
        rank, step = program.sender[transfer]
        forward = program.labels[rank][step][0] == SEND_F
        pairs = zip(boundaries.outputs[stage], boundaries.requires_grad[stage], strict=True)
        return [(t.shape, t.dtype) for t, needed in pairs if forward or needed]

    return spec


def guard(
    whole: WholeModelStages,
    mine: Mapping[int, StageExecutable],
    microbatch: tuple[torch.Tensor, torch.Tensor],
    names: tuple[str, str],
    *,
    tolerance: tuple[float, float] = (0.0, 0.0),
) -> NumericsReport:
    """``check_numerics`` on one micro-batch: this rank's stages as run, the others as written.

    ``tolerance`` (atol, rtol): bitwise by default; compiled stages are held to the compiled tolerance."""

    def runtime_forward(exe: StageExecutable) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        return lambda values: exe.forward_all(values)[0]

    def eager_forward(stage: GraphStage) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        def run(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            with torch.no_grad():
                out = stage(*values)
            return [out] if isinstance(out, torch.Tensor) else list(out)

        return run

    forwards = [runtime_forward(mine[s]) if s in mine else eager_forward(stage) for s, stage in enumerate(whole.stages)]
    # no log here: a rank's stdout is the launching command's (``octopipe run --json``); the figures go back
    # in the rank's result (``RunResult.numerics``) and the launching process reports them
    atol, rtol = tolerance
    inputs = model_inputs(names, *microbatch)
    return check_numerics(whole.graph, whole.stages, inputs, forwards=forwards, atol=atol, rtol=rtol)


def guard_stages(
    whole: WholeModelStages,
    mine: Mapping[int, StageExecutable],
    microbatch: tuple[torch.Tensor, torch.Tensor],
    names: tuple[str, str],
    boundaries: Boundaries,
    process_of_stage: Callable[[int], int],
    *,
    tolerance: tuple[float, float] = (0.0, 0.0),
) -> dict[str, float]:
    """The guard for a model loaded stage by stage (a collective: every rank, stage by stage): the holder of
    stage s runs it as the runtime does and as written on the same inputs and random state, refuses
    (``NumericsError``) if they differ, and broadcasts the stage's outputs to every rank for the next one.
    Returns the figures; ``whole_model_checked`` is 0: the pipelined loss is not compared with the model's
    own whole forward, which needs every weight in one process."""
    start = time.perf_counter()
    inputs = model_inputs(names, *microbatch)
    values = [inputs[n] for n in whole.stages[0].boundary_names]
    targets = [inputs[n] for n in whole.graph.target_names]
    figures = {"whole_model_checked": 0.0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for s, stage in enumerate(whole.stages):
            values = values + targets if stage.is_last else values
            if s in mine:
                state = torch.get_rng_state()
                got = mine[s].forward_all(values)[0]
                torch.set_rng_state(state)
                with torch.no_grad():
                    out = stage(*values)
                values = [out] if isinstance(out, torch.Tensor) else list(out)
                atol, rtol = tolerance
                figures[f"stage{s}_max_abs_diff"] = compare_outputs(s, stage, got, values, atol=atol, rtol=rtol)
                if stage.is_last:
                    figures["pipelined_loss"] = float(got[0].item())
                values = [v.contiguous() for v in values]
            elif not stage.is_last:
                device = microbatch[0].device
                values = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in boundaries.outputs[s]]
            if not stage.is_last:
                for value in values:
                    dist.broadcast(value, src=process_of_stage(s))
    figures["seconds"] = time.perf_counter() - start
    return figures


def reduce_tied(
    ties: Sequence[TiedParameter],
    stages: Sequence[nn.Module],
    runtime: RankRuntime,
    executables: Mapping[int, StageExecutable],
    process_of_stage: Callable[[int], int],
) -> dict[tuple[int, str], torch.Tensor]:
    """Every tied parameter's summed gradient, for each (stage, name) this rank holds (a collective)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    m = runtime.m
    for tie in ties:
        stage0, name0 = tie.uses[0]
        like = stages[stage0].get_parameter(name0)
        partials = []
        for stage, name in sorted(tie.uses, key=lambda use: -use[0]):  # eager autograd meets the later use first
            if stage in executables:
                index = executables[stage].graphs.param_names.index(name)
                grads = runtime.microbatch_grads[(stage, index)]
                missing = [mb for mb, g in enumerate(grads) if g is None]
                if missing:
                    raise RuntimeError(f"stage {stage} computed no gradient of {name!r} for micro-batches {missing}")
                buffer = torch.stack([g for g in grads if g is not None])
            else:
                buffer = torch.empty((m, *like.shape), dtype=like.dtype, device=like.device)
            dist.broadcast(buffer, src=process_of_stage(stage))
            partials.append(buffer)
        total: torch.Tensor | None = None
        for mb in range(m):
            grad = partials[0][mb]
            for partial in partials[1:]:
                grad = grad + partial[mb]
            total = grad.clone() if total is None else total + grad
        assert total is not None
        for stage, name in tie.uses:
            if stage in executables:
                out[(stage, name)] = total
    return out


def tied_indices(ties: Sequence[TiedParameter], executables: Mapping[int, StageExecutable]) -> dict[int, list[int]]:
    """Stage -> the indices of its tied parameters (their gradients are kept per micro-batch)."""
    indices: dict[int, list[int]] = {}
    for tie in ties:
        for stage, name in tie.uses:
            if stage in executables:
                indices.setdefault(stage, []).append(executables[stage].graphs.param_names.index(name))
    return indices
