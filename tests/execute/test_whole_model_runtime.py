"""Models as their authors wrote them, pipelined on 2 real gloo ranks.

transformers models built from configs (tests/execute/hf_sources.py) are captured whole on every
rank and split at the plan's layer boundaries; the reference is the model's own eager
``model(input_ids=..., labels=...)`` + ``(loss / m).backward()`` over the same micro-batches, then
AdamW (``reference_run``). Everything is compared bitwise (``torch.equal``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from octopipe.capture import NumericsError
from octopipe.execute.runtime import RunOptions, build_model, reference_run, run_local, run_local_many
from octopipe.execute.runtime.pipeline import layer_names, profile_reference, tune_reference
from octopipe.execute.runtime.whole_model import guard, whole_model_stages
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import local_cost_model, verify_plan
from octopipe.transform import StageExecutable, compile_stage
from octopipe.tune import TuneConfig, equal_partition, one_f_one_b, zb_h1

transformers = pytest.importorskip("transformers")
TIED = "model.embed_tokens.weight"


def reference(function: str, **config: str) -> plan_pb2.ModelReference:
    model_ref = plan_pb2.ModelReference(name=function, source=f"tests.execute.hf_sources:{function}")
    model_ref.config.update(config)
    return model_ref


def partition(model_ref: plan_pb2.ModelReference, ranks: int) -> list[list[str]]:
    """The layers trace_model discovers (embedding, blocks, norm, lm_head), in ``ranks`` equal stages."""
    assert build_model(model_ref).input_names is not None  # whole-model capture (transformers models by default)
    return equal_partition(layer_names(model_ref), ranks)


def plans(
    model_ref: plan_pb2.ModelReference, m: int, schedules: list[Callable[..., plan_pb2.Plan]]
) -> list[plan_pb2.Plan]:
    names = partition(model_ref, 2)
    out = []
    for schedule in schedules:
        plan = schedule(2, m, layer_names=names)
        plan.model.CopyFrom(model_ref)
        out.append(plan)
    return out


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max |diff| {(actual[name] - value).abs().max().item()}"


@pytest.fixture
def deterministic() -> Iterator[None]:
    """The MoE source turns deterministic mode on (its own eager expert gradients need it); restore it after."""
    previous = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.mark.slow  # about 35 s on 2 shared cores
@pytest.mark.usefixtures("deterministic")
def test_hf_models_on_two_ranks_equal_their_own_training_bitwise() -> None:
    """One launch: tied Llama under 1F1B and ZB-H1 (split backward), Qwen3-MoE (aux loss) under 1F1B, and a
    plain module whose token ids cross the boundary without a gradient (``capture=whole``) under ZB-H1.

    Losses, every first-step gradient and every weight after 3 AdamW steps equal the model's own
    eager training; both copies of the tied embedding get the shared tensor's gradient and stay equal.
    """
    llama, moe, glue, m = reference("llama"), reference("qwen3_moe"), reference("token_glue", capture="whole"), 2
    runs = run_local_many(
        [*plans(llama, m, [one_f_one_b, zb_h1]), *plans(moe, m, [one_f_one_b]), *plans(glue, m, [zb_h1])],
        RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=120),
    )
    llama_ref = reference_run(llama, num_microbatches=m, steps=3)
    for run in runs[:2]:
        assert run.losses == llama_ref.losses
        # the guard ran on both ranks before the first step: the pipelined loss is the model's own
        assert sorted(run.numerics) == [0, 1]
        assert all(n["pipelined_loss"] == n["reference_loss"] for n in run.numerics.values())
        assert_bitwise(llama_ref.grads, run.grads)
        assert_bitwise(llama_ref.params, run.params)
        # rank 0 (embedding) and rank 1 (lm_head) each hold a copy of the tied weight
        assert sorted(run.tied_grads) == [0, 1]
        for rank in (0, 1):
            assert torch.equal(run.tied_grads[rank][TIED], llama_ref.grads[TIED])
            assert torch.equal(run.tied_params[rank][TIED], llama_ref.params[TIED])
        assert torch.equal(run.tied_params[0][TIED], run.tied_params[1][TIED])
    # Qwen3-MoE, output_router_logits=True: stage 0 (embedding, layers 0-1) sends its hidden states and both
    # layers' router logits (all with gradients) to the last stage, where the aux loss joins the loss
    built = build_model(moe)
    assert built.input_names is not None
    x, y = built.batch(0)
    whole = whole_model_stages(built.model, built.input_names, (x[:2], y[:2]), partition(moe, 2))
    assert len(whole.stages[0].output_names) == 3 and all(whole.stages[0].output_requires_grad)
    moe_ref = reference_run(moe, num_microbatches=m, steps=3)
    run = runs[2]
    assert run.losses == moe_ref.losses
    assert all(n["pipelined_loss"] == n["reference_loss"] for n in run.numerics.values()) and len(run.numerics) == 2
    assert_bitwise(moe_ref.grads, run.grads)
    assert_bitwise(moe_ref.params, run.params)
    assert run.tied_grads == {}
    # a plain module: its loss reads the token ids after the last layer, so they cross beside the hidden states
    built = build_model(glue)
    assert built.input_names == ("tokens", "targets")
    x, y = built.batch(0)
    whole = whole_model_stages(built.model, built.input_names, (x[:2], y[:2]), partition(glue, 2))
    # the ids (no gradient), then the hidden states: SEND_F carries two tensors, SEND_B one gradient
    assert whole.stages[0].output_requires_grad == (False, True)
    glue_ref = reference_run(glue, num_microbatches=m, steps=3)
    run = runs[3]
    assert run.losses == glue_ref.losses
    assert all(n["pipelined_loss"] == n["reference_loss"] for n in run.numerics.values()) and len(run.numerics) == 2
    assert_bitwise(glue_ref.grads, run.grads)
    assert_bitwise(glue_ref.params, run.params)


def test_launch_guard_names_a_wrong_stage() -> None:
    """A stage executable that computes something else (perturbed weights) is refused before training."""
    built = build_model(reference("llama"))
    assert built.input_names is not None
    microbatch = tuple(t[:2] for t in built.batch(0))
    assert len(microbatch) == 2
    names = partition(reference("llama"), 2)
    whole = whole_model_stages(built.model, built.input_names, (microbatch[0], microbatch[1]), names)
    right = {s: compile_stage(stage, whole.examples[s], stage_index=s) for s, stage in enumerate(whole.stages)}
    report = guard(whole, right, (microbatch[0], microbatch[1]), built.input_names)
    assert report.pipelined_loss == report.reference_loss
    exe = right[1]
    wrong = StageExecutable(exe.graphs, exe.split, [p + 1e-3 for p in exe.params], exe.buffers)
    with pytest.raises(NumericsError, match=r"stage 1 \(layers model.layers.2 ... lm_head\) computes output"):
        guard(whole, {0: right[0], 1: wrong}, (microbatch[0], microbatch[1]), built.input_names)


#: every (family, attention) pair of tests/hf_models.py, run on 2 ranks
MATRIX = [
    (family, attention)
    for family in (
        "llama_tied",
        "llama_untied",
        "qwen3",
        "qwen3moe",
        "olmoe",
        "gemma3",
        "gpt2",
        "falcon_h1",
        "deepseek_v3",
    )
    for attention in ("sdpa", "eager")
]


@pytest.mark.slow
@pytest.mark.extended  # the default run covers tied Llama, Qwen3-MoE and a plain module (above)
@pytest.mark.usefixtures("deterministic")
def test_every_family_on_two_ranks_equals_its_own_training_bitwise() -> None:
    """One launch, 1F1B, 2 micro-batches, 2 AdamW steps per family and attention kernel: losses, first-step
    gradients and the weights after the steps equal the model's own eager training bitwise."""
    m, steps = 2, 2
    references = [reference("family", name=name, attention=attention) for name, attention in MATRIX]
    runs = run_local_many(
        [plan for model_ref in references for plan in plans(model_ref, m, [one_f_one_b])],
        RunOptions(steps=steps, keep_grads=True, keep_params=True, timeout_s=180),
    )
    for (name, attention), model_ref, run in zip(MATRIX, references, runs, strict=True):
        expected = reference_run(model_ref, num_microbatches=m, steps=steps)
        assert run.losses == expected.losses, (name, attention)
        assert_bitwise(expected.grads, run.grads)
        assert_bitwise(expected.params, run.params)


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("function", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.extended)])
def test_a_model_as_written_is_profiled_tuned_and_run_as_written(function: str) -> None:
    """The first-hour flow on a tied Llama and on Qwen3-MoE (router logits cross every boundary): the
    profile times the one-layer stages of the model's own traced forward (the tied embedding counted on
    both layers that hold a copy; every boundary tensor listed), the tuned plan verifies on the costs it
    was tuned with, and its run equals the model's own eager training bitwise."""
    model_ref, m = reference(function), 2
    profile = profile_reference(model_ref, num_microbatches=m, num_ranks=2, repeats=1)
    names = [layer.layer_name for layer in profile.layers]
    assert names == layer_names(model_ref)
    by_name = {layer.layer_name: layer for layer in profile.layers}
    if function == "llama":  # tied: the embedding and the output projection each hold the weight
        assert by_name["model.embed_tokens"].parameter_bytes == by_name["lm_head"].parameter_bytes == 96 * 32 * 4
        (tie,) = profile.tied_parameters  # which the simulator exchanges at the end of the step
        assert (tie.name, tie.size_bytes, list(tie.layer_names)) == (
            TIED,
            96 * 32 * 4,
            ["model.embed_tokens", "lm_head"],
        )
    else:  # each block passes its router logits on beside the hidden states
        assert len(by_name["model.layers.0"].output_tensors) == 2
        assert len(by_name["model.layers.1"].output_tensors) == 3
    tuned = tune_reference(profile, TuneConfig(num_ranks=2, num_microbatches=m, time_budget_s=2))
    verify_plan(tuned.plan, local_cost_model(tuned.plan, profile))
    run = run_local(tuned.plan, RunOptions(steps=2, keep_grads=True, keep_params=True, pin_cores=False, timeout_s=120))
    expected = reference_run(model_ref, num_microbatches=m, steps=2)
    assert run.losses == expected.losses
    assert_bitwise(expected.grads, run.grads)
    assert_bitwise(expected.params, run.params)
