"""The numerics guard: passes when the pipelined forward reproduces the model's loss, names a perturbed stage."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from octopipe.capture import (
    NumericsError,
    captured_forwards,
    check_numerics,
    split_graph,
    trace_model,
)
from octopipe.examples.models import ModelConfig, llama
from tests.capture.whole_model import example_activations
from tests.hf_models import llama as hf_llama

transformers = pytest.importorskip("transformers")


def llama_graph() -> tuple[object, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = hf_llama("sdpa", tied=True)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_guard_passes_bitwise_and_names_a_perturbed_stage() -> None:
    model, inputs = llama_graph()
    graph = trace_model(model, inputs)  # type: ignore[arg-type]
    names = graph.layers
    stages = split_graph(graph, [list(names[:2]), list(names[2:4]), list(names[4:])], allow_tied=True)
    forwards = captured_forwards(stages, example_activations(stages, graph))
    report = check_numerics(graph, stages, inputs, forwards=forwards)
    assert report.pipelined_loss == report.reference_loss
    assert report.max_abs_diff == (0.0, 0.0, 0.0)

    def perturbed(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (hidden,) = forwards[1](inputs)
        return [hidden * (1 + 2**-20)]  # a stage off by about one part in a million

    with pytest.raises(NumericsError, match=r"stage 1 \(layers model.layers.1 ... model.layers.2\) computes output"):
        check_numerics(graph, stages, inputs, forwards=[forwards[0], perturbed, forwards[2]])
    # with a stated tolerance the same stage is accepted, but the loss still has to match the model's within it
    report = check_numerics(graph, stages, inputs, forwards=[forwards[0], perturbed, forwards[2]], atol=1e-4, rtol=1e-4)
    assert report.max_abs_diff[1] > 0


def test_guard_catches_a_capture_that_computes_something_else() -> None:
    """Every stage matches its own ops, but the graph differs from the model (here: the model changed after capture)."""
    torch.manual_seed(0)
    config = ModelConfig.tiny()
    model = llama(2, config)
    tokens = torch.randint(0, config.vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    graph = trace_model(model, inputs)
    stages = split_graph(graph, [list(graph.layers[:2]), list(graph.layers[2:])])
    check_numerics(graph, stages, inputs)  # default: captures each stage itself
    model.pipeline_loss = lambda logits, targets: torch.nn.functional.cross_entropy(  # type: ignore[method-assign]
        logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1
    )
    with pytest.raises(NumericsError, match="although every stage matches its own ops"):
        check_numerics(graph, stages, inputs)
