"""The B/W split by graph analysis: every backward node runs once, in B or W; B hands W exactly what it needs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import fx

from octopipe.capture import StageGraphs, StageModule, capture_stage, split_model
from octopipe.examples.models import ModelConfig, jamba, llama
from octopipe.transform import StageExecutable, split_backward


def ops(gm: fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def middle_stage(model_name: str = "llama") -> tuple[list[StageModule], StageGraphs, torch.Tensor]:
    torch.manual_seed(0)
    model = llama(3, ModelConfig.tiny()) if model_name == "llama" else jamba(4, ModelConfig.tiny())
    names = model.pipeline_layers()
    stages = split_model(model, [names[:2], names[2:-2], names[-2:]])
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        hidden = stages[0](tokens)
    return stages, capture_stage(stages[1], [hidden], stage_index=1), hidden


@pytest.mark.parametrize("model_name", ["llama", "jamba"])
def test_every_node_runs_once(model_name: str) -> None:
    _, graphs, _ = middle_stage(model_name)
    before = ops(graphs.backward)
    count = len(graphs.backward.graph.nodes)
    split = split_backward(graphs.backward, num_params=graphs.num_params, num_inputs=graphs.num_inputs)
    assert ops(split.backward_input) + ops(split.backward_weight) == before
    assert len(graphs.backward.graph.nodes) == count  # a pure function: the input graph is untouched
    assert split.num_stash > 0
    assert ops(split.backward_weight)["aten.mm.default"] > 0  # weight gradients are matmuls in W


def test_b_returns_exactly_what_w_needs() -> None:
    _, graphs, _ = middle_stage()
    split = split_backward(graphs.backward, num_params=graphs.num_params, num_inputs=graphs.num_inputs)
    w_placeholders = [n for n in split.backward_weight.graph.nodes if n.op == "placeholder"]
    assert len(w_placeholders) == split.num_stash + len(split.w_inputs)
    for placeholder in w_placeholders:
        assert placeholder.users, f"W takes {placeholder.name} but never uses it"
    b_output = next(n for n in split.backward_input.graph.nodes if n.op == "output").args[0]
    assert len(b_output) == split.num_input_grads + split.num_stash
    assert b_output[0] is not None  # the input gradient


def test_first_stage_has_no_input_gradient_so_w_is_everything() -> None:
    stages, _, _ = middle_stage()
    graphs = capture_stage(stages[0], [torch.randint(0, 64, (2, 8))])
    split = split_backward(graphs.backward, num_params=graphs.num_params, num_inputs=graphs.num_inputs)
    assert not ops(split.backward_input)
    assert ops(split.backward_weight) == ops(graphs.backward)


def test_contexts_release_activations() -> None:
    stages, graphs, hidden = middle_stage()
    exe = StageExecutable.from_module(stages[1], graphs)
    out, ctx = exe.forward([hidden])
    input_grads, wctx = exe.backward_input(ctx, torch.ones_like(out))
    assert ctx.saved is None
    assert input_grads[0] is not None and input_grads[0].shape == hidden.shape
    assert wctx.tensors is not None and len(wctx.tensors) == exe.split.num_stash + len(exe.split.w_inputs)
    grads = exe.backward_weight(wctx)
    assert wctx.tensors is None
    assert len(grads) == graphs.num_params
    with pytest.raises(RuntimeError, match="already ran"):
        exe.backward_weight(wctx)
    with pytest.raises(RuntimeError, match="already ran"):
        exe.backward_input(ctx, torch.ones_like(out))


def test_split_checks_the_output_count() -> None:
    _, graphs, _ = middle_stage()
    with pytest.raises(ValueError, match="fewer than"):
        split_backward(graphs.backward, num_params=graphs.num_params + 100, num_inputs=1)
