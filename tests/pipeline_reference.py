"""Run a split model stage by stage (F for all, then B for all, then W) and compare with eager autograd."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture import CaptureConfig, split_model
from octopipe.transform import StageExecutable, compile_stage


@dataclass
class Result:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    input_grads: list[torch.Tensor | None]
    stages: list[StageExecutable]


def eager_reference(model: nn.Module, loss_of: object, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of()  # type: ignore[operator]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def run_split(
    model: nn.Module,
    partition: Sequence[Sequence[str]],
    inputs: torch.Tensor,
    target: torch.Tensor,
    *,
    seed: int,
    fused: bool = False,
    config: CaptureConfig | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Result:
    """Capture every stage, then F all stages, B (or the fused backward) in reverse, W last."""
    stages = split_model(model, partition, loss=loss)
    with torch.no_grad():  # example activations for tracing
        activations = [inputs]
        for stage in stages[:-1]:
            activations.append(stage(activations[-1]))
    executables = [
        compile_stage(
            stage, [activations[s]] if s < len(stages) - 1 else [activations[s], target], config=config, stage_index=s
        )
        for s, stage in enumerate(stages)
    ]
    torch.manual_seed(seed)
    contexts = []
    x = inputs
    for s, exe in enumerate(executables):
        x, ctx = exe.forward([x] if s < len(stages) - 1 else [x, target])
        contexts.append(ctx)
    final = x
    grad: torch.Tensor | None = torch.ones_like(final)
    grads: dict[str, torch.Tensor] = {}
    pending = []
    input_grads: list[torch.Tensor | None] = []
    for s in reversed(range(len(stages))):
        assert grad is not None
        exe = executables[s]
        if fused:
            input_grads, param_grads = exe.full_backward(contexts[s], grad)
            grads.update({n: g for n, g in zip(exe.graphs.param_names, param_grads, strict=True) if g is not None})
        else:
            input_grads, wctx = exe.backward_input(contexts[s], grad)
            pending.append((exe, wctx))
        grad = input_grads[0]
    for exe, wctx in pending:
        param_grads = exe.backward_weight(wctx)
        grads.update({n: g for n, g in zip(exe.graphs.param_names, param_grads, strict=True) if g is not None})
    return Result(loss=final, grads=grads, input_grads=input_grads, stages=executables)


def assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], *, bitwise: bool) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        if bitwise:
            assert torch.equal(actual[name], value), f"{name}: max |diff| {(actual[name] - value).abs().max().item()}"
        else:
            try:
                torch.testing.assert_close(actual[name], value)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
