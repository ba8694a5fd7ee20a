"""Run a whole-model-captured, split model stage by stage and compare it with the model's own eager run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture import CaptureConfig, GraphStage, ModelGraph, split_graph, tied_parameters
from octopipe.transform import StageExecutable, compile_stage


@dataclass
class Split:
    loss: torch.Tensor
    #: gradients under the model's own parameter names (tied copies summed)
    grads: dict[str, torch.Tensor]
    stages: list[GraphStage]
    executables: list[StageExecutable]


def model_reference(
    model: nn.Module, inputs: Mapping[str, torch.Tensor], seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own eager ``model(**inputs)`` loss and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def example_activations(stages: Sequence[GraphStage], graph: ModelGraph) -> list[list[torch.Tensor]]:
    """Each stage's example inputs: one eager pass through the split stages."""
    values = [graph.example_inputs[n] for n in stages[0].boundary_names]
    per_stage = []
    with torch.no_grad():
        for stage in stages:
            if stage.is_last:
                values = values + [graph.example_inputs[n] for n in graph.target_names]
            per_stage.append(values)
            out = stage(*values)
            values = [out] if isinstance(out, torch.Tensor) else list(out)
    return per_stage


def run_graph_split(
    graph: ModelGraph,
    partition: Sequence[Sequence[str]],
    inputs: Mapping[str, torch.Tensor],
    *,
    fused: bool,
    seed: int = 0,
    config: CaptureConfig | None = None,
) -> Split:
    """Capture every stage, F all stages, then B (or the fused backward) in reverse, W last."""
    stages = split_graph(graph, partition, allow_tied=True)
    examples = example_activations(stages, graph)
    executables = [compile_stage(stage, examples[s], config=config, stage_index=s) for s, stage in enumerate(stages)]
    torch.manual_seed(seed)
    contexts = []
    values = [inputs[n] for n in stages[0].boundary_names]
    for stage, exe in zip(stages, executables, strict=True):
        if stage.is_last:
            values = values + [inputs[n] for n in graph.target_names]
        values, ctx = exe.forward_all(values)
        contexts.append(ctx)
    (loss,) = values
    grads_out: list[torch.Tensor | None] = [torch.ones_like(loss)]
    per_stage: dict[tuple[int, str], torch.Tensor] = {}
    pending = []
    for s in reversed(range(len(stages))):
        exe = executables[s]
        if fused:
            input_grads, param_grads = exe.full_backward_all(contexts[s], grads_out)
            per_stage.update(
                {(s, n): g for n, g in zip(exe.graphs.param_names, param_grads, strict=True) if g is not None}
            )
        else:
            input_grads, wctx = exe.backward_input_all(contexts[s], grads_out)
            pending.append((s, exe, wctx))
        if s > 0:  # the previous stage's outputs are this stage's leading inputs
            grads_out = list(input_grads[: len(stages[s - 1].output_names)])
    for s, exe, wctx in pending:
        param_grads = exe.backward_weight(wctx)
        per_stage.update({(s, n): g for n, g in zip(exe.graphs.param_names, param_grads, strict=True) if g is not None})
    # the model's own names; a tied parameter's copies are summed, as the runtime must do across ranks
    canonical = {id(p): n for n, p in graph.model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    tied = {(s, n) for t in tied_parameters(stages) for s, n in t.uses}
    for s, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            grad = per_stage.get((s, name))
            if grad is None:
                continue
            key = canonical[id(param)]
            if key in grads and (s, name) in tied:
                grads[key] = grads[key] + grad
            else:
                grads[key] = grad
    return Split(loss=loss, grads=grads, stages=stages, executables=executables)


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max |diff| {(actual[name] - value).abs().max().item()}"
