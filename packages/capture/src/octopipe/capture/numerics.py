"""The numerics guard: before training, the pipelined forward must reproduce the model's own loss.

``check_numerics`` runs one micro-batch through the stages' pipelined forwards
(the captured graphs a runtime executes) and compares

1. each stage's outputs with the same stage's ops run eagerly on the same
   inputs and random state -- a stage whose capture or compilation changed
   the numbers is named;
2. the last stage's loss with the model's own eager ``model(**inputs)`` loss
   -- a whole-model capture that computes something else is caught too.

Bitwise by default (the same ATen ops run); ``atol``/``rtol`` state a tolerance
where the ops legitimately differ (e.g. Inductor-compiled stages). On a
mismatch it raises ``NumericsError``, naming the stage and its layers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from octopipe.capture.graph_split import GraphStage
from octopipe.capture.graphs import StageGraphs
from octopipe.capture.model_graph import ModelGraph
from octopipe.capture.trace import capture_stage

__all__ = [
    "NumericsError",
    "NumericsReport",
    "StageForward",
    "captured_forwards",
    "check_numerics",
    "compare_outputs",
]

#: a stage's pipelined forward: its inputs (boundary values, then targets on the last stage) to its outputs
StageForward = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


class NumericsError(RuntimeError):
    """The pipelined model does not compute what the model computes; the message names the stage."""


@dataclass(frozen=True)
class NumericsReport:
    """What the guard compared: the model's own loss, the pipelined one, per-stage max |diff|, seconds taken."""

    reference_loss: float
    pipelined_loss: float
    max_abs_diff: tuple[float, ...]
    seconds: float


def captured_forwards(stages: Sequence[GraphStage], example: Sequence[Sequence[torch.Tensor]]) -> list[StageForward]:
    """Capture each stage (as a runtime would) and return its forward graph bound to the stage's tensors."""
    forwards: list[StageForward] = []
    for s, stage in enumerate(stages):
        graphs = capture_stage(stage, list(example[s]), stage_index=s)
        params = dict(stage.named_parameters())
        buffers = dict(stage.named_buffers())
        bound_params = [params[n].detach() for n in graphs.param_names]
        bound_buffers = [buffers[n] for n in graphs.buffer_names]

        def forward(
            inputs: Sequence[torch.Tensor],
            graphs: StageGraphs = graphs,
            p: list[torch.Tensor] = bound_params,
            b: list[torch.Tensor] = bound_buffers,
        ) -> list[torch.Tensor]:
            with torch.no_grad():
                outputs, _ = graphs.run_forward(p, b, list(inputs))
            return list(outputs)

        forwards.append(forward)
    return forwards


def _differs(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float | None:
    """max |diff| when ``actual`` is not ``expected`` (bitwise, or within atol + rtol·|expected|), else None."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return float("inf")
    if atol == 0.0 and rtol == 0.0:
        if torch.equal(actual, expected):
            return None
    elif torch.allclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True):
        return None
    if not actual.is_floating_point():
        return float("inf")
    return float((actual - expected).abs().max().item()) if actual.numel() else float("inf")


def compare_outputs(
    index: int,
    stage: GraphStage,
    got: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> float:
    """The largest |diff| of stage ``index``'s pipelined outputs ``got`` from its own ops' ``expected``;
    ``NumericsError``, naming the stage and output, when one is not equal (bitwise, or within the tolerance)."""
    worst = 0.0
    for name, actual, want in zip(stage.output_names, got, expected, strict=True):
        diff = _differs(actual, want, atol, rtol)
        if diff is not None:
            raise NumericsError(
                f"stage {index} (layers {stage.layer_names[0]} ... {stage.layer_names[-1]}) computes output "
                f"{name!r} differently from the model's own ops on the same inputs (max |diff| {diff:.3g}"
                f"{'' if atol == rtol == 0 else f', tolerance atol={atol} rtol={rtol}'}): octopipe refuses "
                "to train it. Capture this stage again without the pass that changed it, or state a "
                "tolerance; --skip-numerics-check skips this check"
            )
        if actual.is_floating_point() and actual.numel():
            worst = max(worst, float((actual - want).abs().max().item()))
    return worst


def check_numerics(
    graph: ModelGraph,
    stages: Sequence[GraphStage],
    inputs: Mapping[str, torch.Tensor],
    *,
    forwards: Sequence[StageForward] | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
) -> NumericsReport:
    """Refuse (``NumericsError``) unless the pipelined forward reproduces the model's own loss on ``inputs``.

    ``forwards[s]`` is stage s's forward as the runtime runs it (default: each
    stage captured here). ``inputs`` is one micro-batch, by the model's input
    names. The model is not changed; the random state is restored afterwards.
    """
    if len(stages) == 0:
        raise ValueError("give the stages split_graph returned")
    if forwards is not None and len(forwards) != len(stages):
        raise ValueError(f"give one forward per stage: {len(stages)} stages, {len(forwards)} forwards")
    start = time.perf_counter()
    first = [inputs[n] for n in stages[0].boundary_names]
    targets = [inputs[n] for n in graph.target_names]
    with torch.random.fork_rng(devices=[]):
        if forwards is None:
            forwards = captured_forwards(stages, _examples(stages, first, targets))
        torch.manual_seed(seed)
        states, stage_inputs, outputs = [], [], []
        values = first
        for stage, forward in zip(stages, forwards, strict=True):  # the pipeline's order of random draws
            values = values + targets if stage.is_last else values
            states.append(torch.get_rng_state())
            stage_inputs.append(values)
            values = list(forward(values))
            outputs.append(values)
        diffs = []
        for s, stage in enumerate(stages):
            torch.set_rng_state(states[s])
            with torch.no_grad():
                out = stage(*stage_inputs[s])
            expected = [out] if isinstance(out, torch.Tensor) else list(out)
            diffs.append(compare_outputs(s, stage, outputs[s], expected, atol=atol, rtol=rtol))
        torch.manual_seed(seed)
        with torch.no_grad():
            reference = graph.eager_loss(inputs)
    (pipelined,) = outputs[-1]
    diff = _differs(pipelined, reference, atol, rtol)
    if diff is not None:
        raise NumericsError(
            f"the pipelined loss {pipelined.item()!r} differs from the model's own loss {reference.item()!r} "
            f"(|diff| {diff:.3g}) although every stage matches its own ops: the whole-model capture computes "
            "something the model's forward does not. Report the model; --skip-numerics-check skips this check"
        )
    return NumericsReport(
        reference_loss=float(reference.item()),
        pipelined_loss=float(pipelined.item()),
        max_abs_diff=tuple(diffs),
        seconds=time.perf_counter() - start,
    )


def _examples(
    stages: Sequence[GraphStage], first: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    examples = []
    values = first
    with torch.no_grad():
        for stage in stages:
            values = values + targets if stage.is_last else values
            examples.append(values)
            out = stage(*values)
            values = [out] if isinstance(out, torch.Tensor) else list(out)
    return examples
