"""Run a torch CSV schedule with torch.distributed.pipelining's own runtime, on real gloo ranks.

``torch_gradients(plan, [(csv_text, format), ...])`` runs each CSV in one
launch of gloo ranks: every rank builds the plan's model afresh (same seed as
octopipe's workers), splits it into the plan's stages, wraps each in a
``PipelineStage``, loads the CSV into ``_PipelineScheduleRuntime`` and runs
one step on the first global batch. It returns, per CSV, every parameter's
gradient after the step: what torch computes for that order.

The last stage's loss moves out of the module into torch's ``loss_fn`` (torch
calls it on the stage's output and the target); the loss of each micro-batch
is back-propagated unscaled and torch divides the accumulated gradients by the
micro-batch count at REDUCE_GRAD (``scale_grads=True``), so the gradients are
those of the mean loss, as in octopipe.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from octopipe.capture import StageModule, split_model
from octopipe.execute.runtime import build_model
from octopipe.ir import stage_ranks
from octopipe.plan.v1 import plan_pb2
from tests.transform.gloo import run_ranks


class _WithoutLoss(nn.Module):
    """A last stage that returns what its loss is computed from (torch's ``loss_fn`` computes the loss)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for run in self.stage._runs:
            x = run(self.stage, x)
        return x


def _rank(rank: int, world: int, plan_bytes: bytes, schedules: list[tuple[str, str]], out: str) -> None:
    torch.set_num_threads(1)
    plan = plan_pb2.Plan.FromString(plan_bytes)
    for index, (csv_path, fmt) in enumerate(schedules):
        grads = _one_step(rank, plan, csv_path, fmt)
        torch.save(grads, Path(out) / f"rank{rank}-{index}.pt")


def _one_step(rank: int, plan: plan_pb2.Plan, csv_path: str, fmt: str) -> dict[str, torch.Tensor]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    built = build_model(plan.model, seed=0)
    stages = split_model(built.model, [list(s.layer_names) for s in plan.stages])
    last = stages[-1]
    mine = sorted(s for s, r in stage_ranks(plan).items() if r == rank)
    pipeline_stages = [
        PipelineStage(
            _WithoutLoss(stages[s]) if s == len(stages) - 1 else stages[s],
            s,
            len(stages),
            torch.device("cpu"),
            group=dist.group.WORLD,
        )
        for s in mine
    ]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert last._loss is not None
        return last._loss(last, output, target)

    schedule = _PipelineScheduleRuntime(pipeline_stages, plan.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    schedule._load_csv(csv_path, format=fmt)  # type: ignore[arg-type]
    tokens, targets = built.batch(0)
    args: list[Any] = [tokens] if 0 in mine else []
    kwargs: dict[str, Any] = {"target": targets} if len(stages) - 1 in mine else {}
    schedule.step(*args, **kwargs)
    return {name: p.grad.clone() for s in mine for name, p in stages[s].named_parameters() if p.grad is not None}


def torch_gradients(plan: plan_pb2.Plan, schedules: list[tuple[str, str]]) -> list[dict[str, torch.Tensor]]:
    """Per (CSV text, format) in ``schedules``: every parameter's gradient after torch's runtime ran it."""
    with tempfile.TemporaryDirectory(prefix="octopipe-torch-") as folder:
        paths = []
        for index, (text, fmt) in enumerate(schedules):
            path = os.path.join(folder, f"schedule{index}.csv")
            Path(path).write_text(text)
            paths.append((path, fmt))
        run_ranks(_rank, len(plan.ranks), plan.SerializeToString(), paths, folder, timeout_s=180)
        results: list[dict[str, torch.Tensor]] = []
        for index in range(len(schedules)):
            grads: dict[str, torch.Tensor] = {}
            for rank in range(len(plan.ranks)):
                grads.update(torch.load(Path(folder) / f"rank{rank}-{index}.pt", weights_only=True))
            results.append(grads)
    return results
