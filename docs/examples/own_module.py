"""Your own ``nn.Module`` through octopipe: profile, tune, verify, run on 2 local CPU ranks, check the losses.

    .venv/bin/python docs/examples/own_module.py

The runtime builds the model in every rank process from a ``ModelReference``
naming ``module:function``; the function returns ``(model, batch_fn)`` and this
file is that module (``own_module:build``), so the rank processes import it too.
"""

# ruff: noqa: T201 - an example prints what it finds

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octopipe.execute import configure_logging
from octopipe.execute.runtime import RunOptions, reference_run, run_local
from octopipe.execute.runtime.pipeline import profile_reference, tune_reference
from octopipe.ir import format_grid
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import local_cost_model, verify_plan
from octopipe.tune import TuneConfig

VOCAB, HIDDEN, SEQUENCE, BATCH = 64, 32, 16, 16


class Block(nn.Module):
    """A residual MLP block; ``wide`` blocks cost about 4x the others (a heterogeneous stack)."""

    def __init__(self, wide: bool) -> None:
        super().__init__()
        inner = 8 * HIDDEN if wide else 2 * HIDDEN
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, inner)
        self.down = nn.Linear(inner, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """What octopipe needs from a model: its layers in execution order and a loss on the last one's output."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(wide=i % 3 == 2) for i in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def pipeline_layers(self) -> list[str]:
        """Module names in execution order: each is one unit a stage boundary may fall between."""
        return ["embed", *[f"layers.{i}" for i in range(len(self.layers))], "head"]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The eager model (for the reference run): the layers in order, then the loss."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_loss(self.head(x), targets)


def build(layers: str = "6") -> tuple[nn.Module, object]:
    """The model (seeded by the runtime before this call) and ``batch(step) -> (inputs, targets)``."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=torch.Generator().manual_seed(step))
        return tokens[:, :-1], tokens[:, 1:]

    return TinyLM(int(layers)), batch


def main() -> None:
    configure_logging()  # structlog events to stderr (JSON lines when it is not a terminal)
    reference = plan_pb2.ModelReference(name="tiny-lm", source="own_module:build")
    reference.config["layers"] = "6"
    microbatches, ranks = 4, 2

    profile = profile_reference(reference, num_microbatches=microbatches, num_ranks=ranks, repeats=3)
    tuned = tune_reference(profile, TuneConfig(num_ranks=ranks, num_microbatches=microbatches, time_budget_s=5))
    verify_plan(tuned.plan, local_cost_model(tuned.plan, profile))
    print(f"tuned: {tuned.description}; predicted {tuned.speedup:.2f}x over 1F1B with equal layer counts")
    print(format_grid(tuned.plan, compute_only=True), end="")

    run = run_local(tuned.plan, RunOptions(steps=2, pin_cores=False))
    eager = reference_run(reference, num_microbatches=microbatches, steps=2)
    print(f"pipelined losses {run.losses}")
    print(f"eager losses     {eager.losses}")
    print("same losses as eager:", run.losses == eager.losses)


if __name__ == "__main__":
    main()
