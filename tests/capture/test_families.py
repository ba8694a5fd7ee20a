"""More transformers families, whole-model captured and split: bitwise loss and every gradient, or a clear refusal.

Gemma3 (scaled embeddings, sliding-window layers), GPT2 (``transformer.h``, tied ``wte``),
FalconH1 (hybrid Mamba/attention, non-1.0 multipliers), DeepseekV3 (MLA + MoE), and Qwen3,
Qwen3-MoE and OLMoE with eager attention, all built from configs with random weights. Deterministic mode: MoE expert gradients accumulate with
index_put, which repeats bitwise run to run only there (the reference runs under it too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from octopipe.capture import trace_model
from tests.capture.whole_model import assert_bitwise, model_reference, run_graph_split
from tests.hf_models import FAMILIES as HF
from tests.hf_models import gpt2

transformers = pytest.importorskip("transformers")
FAMILIES: dict[str, Callable[[str], Any]] = {
    name: HF[name] for name in ("gemma3", "gpt2", "falcon_h1", "deepseek_v3", "qwen3", "qwen3moe", "olmoe")
}
#: eager attention is the same split of another kernel: those variants are extended (CI runs them; --quick leaves them out)
EXTENDED = pytest.mark.extended
CASES = [
    ("gemma3", "sdpa"),
    pytest.param("gemma3", "eager", marks=EXTENDED),
    ("gpt2", "sdpa"),
    ("gpt2", "eager"),  # its eager attention multiplies the KV cache's contiguous keys: captured as called
    # CI's budget (13 s): Mamba layers are captured bitwise by default in the zoo's jamba-8 and nemotronh runs
    pytest.param("falcon_h1", "sdpa", marks=EXTENDED),
    pytest.param("falcon_h1", "eager", marks=EXTENDED),
    ("deepseek_v3", "sdpa"),
    pytest.param("deepseek_v3", "eager", marks=EXTENDED),
    # with sdpa these run in test_whole_model.py
    pytest.param("qwen3", "eager", marks=EXTENDED),
    pytest.param("qwen3moe", "eager", marks=EXTENDED),
    pytest.param("olmoe", "eager", marks=EXTENDED),
]


@pytest.fixture
def deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize(("family", "attention"), CASES)
def test_family_two_and_three_stages_bitwise(family: str, attention: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family](attention)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    loss, grads = model_reference(model, inputs)
    graph = trace_model(model, inputs)
    names = list(graph.layers)
    for partition, fused in (
        ([names[: len(names) // 2], names[len(names) // 2 :]], False),
        ([names[:2], names[2:4], names[4:]], True),
    ):
        result = run_graph_split(graph, partition, inputs, fused=fused)
        assert torch.equal(result.loss, loss)
        assert_bitwise(grads, result.grads)


def test_gpt2_layers_follow_its_own_module_layout() -> None:
    graph = trace_model(
        gpt2("sdpa"), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    )
    assert graph.layers == (
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
        "lm_head",
    )
