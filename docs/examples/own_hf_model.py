"""A HuggingFace transformers model through octopipe: profile, tune, verify, run on 2 local CPU ranks.

    .venv/bin/python docs/examples/own_hf_model.py

A ``LlamaForCausalLM`` built from a small config with random weights (nothing
is downloaded). octopipe recognises HF ``*ForCausalLM`` decoders: the layers are
``model.embed_tokens``, ``model.layers.<i>``, ``model.norm`` and ``lm_head``, and
the loss is the model's own ``loss_function`` (labels are shifted inside it, so
the targets are the input ids). The rank processes build the model from the
reference ``own_hf_model:build``, this file.
"""

# ruff: noqa: T201 - an example prints what it finds

from __future__ import annotations

import torch
import transformers
from torch import nn

from octopipe.execute import configure_logging
from octopipe.execute.runtime import RunOptions, run_local
from octopipe.execute.runtime.pipeline import profile_reference, tune_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import local_cost_model, verify_plan
from octopipe.tune import TuneConfig

VOCAB, SEQUENCE, BATCH = 128, 16, 8


def build(layers: str = "4") -> tuple[nn.Module, object]:
    """The model (seeded by the runtime before this call) and ``batch(step) -> (input_ids, labels)``."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=int(layers),
    )

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(step))
        return tokens, tokens

    return transformers.LlamaForCausalLM(config), batch


def eager_losses(steps: int, microbatches: int) -> list[float]:
    """The same training on one process, without octopipe: HF forward with labels, AdamW."""
    torch.manual_seed(0)  # the runtime seeds with 0 before build()
    model, batch = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for step in range(steps):
        inputs, labels = batch(step)  # type: ignore[operator]
        total = torch.zeros(())
        for x, y in zip(inputs.chunk(microbatches), labels.chunk(microbatches), strict=True):
            loss = model(input_ids=x, labels=y).loss / microbatches
            loss.backward()
            total += loss.detach()
        losses.append(float(total))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def main() -> None:
    configure_logging()
    torch.set_num_threads(1)  # as on every rank
    reference = plan_pb2.ModelReference(name="hf-llama-4", source="own_hf_model:build")
    microbatches, ranks = 4, 2

    profile = profile_reference(reference, num_microbatches=microbatches, num_ranks=ranks, repeats=3)
    print("layers:", " ".join(layer.layer_name for layer in profile.layers))
    tuned = tune_reference(profile, TuneConfig(num_ranks=ranks, num_microbatches=microbatches, time_budget_s=5))
    verify_plan(tuned.plan, local_cost_model(tuned.plan, profile))
    print(f"tuned: {tuned.description}")

    run = run_local(tuned.plan, RunOptions(steps=2, pin_cores=False))
    eager = eager_losses(steps=2, microbatches=microbatches)
    print(f"pipelined losses {run.losses}")
    print(f"eager losses     {eager}")
    print("same losses as eager:", torch.allclose(torch.tensor(run.losses), torch.tensor(eager)))


if __name__ == "__main__":
    main()
