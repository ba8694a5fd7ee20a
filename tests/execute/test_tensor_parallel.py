"""Tensor and context parallelism inside stages, on real gloo processes, against the single-process reference.

tp=2 on one stage, pp=2 x tp=2 (4 processes), cp=2 on an attention stack and
sequence parallelism (tp=2, with and without cp=2) run
1F1B and ZB-H1 for 3 AdamW steps: the loss of every step, every gradient of the
first step and every weight after the last step equal the reference's within
fp32 tolerance (``assert_close``'s defaults). Not bitwise: a row-parallel
layer sums its hidden units in two halves and all-reduces them, context-
parallel attention masks explicitly instead of ``is_causal``. Whole tensors
come from the slices (``MeshRank.full``), under the model's parameter names.

Where the collectives land: tensor parallelism's all-reduces are in the
forward and in the input-gradient (B) graph (with sequence parallelism an
all-gather in and a reduce-scatter out of each layer, and the reverse in B),
context parallelism's all-gather in the forward and its reduce-scatter in B; a
ZB weight-gradient (W) graph carries none (a weight gradient that needs a
reduced value takes it from B's stash; sequence parallelism's replicated
weights are averaged over the tp ranks after the step, outside the graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from octopipe.capture import split_model
from octopipe.execute.runtime import (
    RunOptions,
    RunResult,
    build_model,
    reference_run,
    run_local_many,
    workload_reference,
)
from octopipe.execute.runtime.context_parallel import context_parallel
from octopipe.execute.runtime.tensor_parallel import split_stage, tensor_parallel
from octopipe.execute.training import Optimization
from octopipe.ir import MeshCoord, PlanError, check_mesh_model, mesh_spec, rank_actions, with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import compile_stage
from octopipe.transform.collectives import COLLECTIVE_KINDS, is_collective, packet
from octopipe.tune import CollectivePlacement, equal_partition, one_f_one_b, zb_h1
from tests.execute.test_mesh_runtime import assert_tensors_close
from tests.execute.test_runtime import overlapped_1f1b
from tests.transform.gloo import default_group, run_ranks

M = 4
#: UNSHARD one compute action ahead of the stage's first use, RESHARD after its last (as test_mesh_runtime)
AHEAD = CollectivePlacement(prefetch=False, ahead=1, reshard=True)
OPTIONS = RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=180, pin_cores=False)


def split_plans(
    workload: str, *, pp: int, tp: int = 1, cp: int = 1, dp: int = 1, overlap: bool = False, sp: bool = False
) -> list[plan_pb2.Plan]:
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=M * dp)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plans = [
        one_f_one_b(pp, M, layer_names=equal_partition(names, pp)),
        zb_h1(pp, M, layer_names=equal_partition(names, pp)),
    ]
    if overlap:
        plans.append(overlapped_1f1b(pp, M, layer_names=equal_partition(names, pp)))
    for plan in plans:
        plan.model.CopyFrom(reference)
        plan.mesh.tp = tp
        plan.mesh.cp = cp
        plan.mesh.dp = dp
        plan.mesh.sequence_parallel = sp
    return [with_collectives(p, AHEAD) for p in plans] if dp > 1 else plans


def assert_matches_reference(plans: Sequence[plan_pb2.Plan], runs: Sequence[RunResult], *, params: bool = True) -> None:
    ref = reference_run(plans[0].model, num_microbatches=M * mesh_spec(plans[0]).dp, steps=3)
    for plan, run in zip(plans, runs, strict=True):
        assert run.losses == pytest.approx(ref.losses, rel=1e-6), plan.name
        assert_tensors_close(plan.name, "grad", ref.grads, run.grads)
        if params:
            assert_tensors_close(plan.name, "param", ref.params, run.params)
        spec = mesh_spec(plan)
        assert sorted(run.timelines) == list(range(spec.world_size))  # one process per mesh coordinate
        for rank, steps in run.timelines.items():
            done = [r.action for r in steps[0].records]
            assert done == [str(a) for a in rank_actions(plan)[spec.position(rank).pp]]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["llama-8", "nemotronh-16"])
def test_tp2_on_one_stage_equals_the_reference(workload: str) -> None:
    plans = split_plans(workload, pp=1, tp=2)
    assert_matches_reference(plans, run_local_many(plans, OPTIONS))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["llama-8", "nemotronh-16"])
def test_pp2_tp2_equals_the_reference(workload: str) -> None:
    plans = split_plans(workload, pp=2, tp=2, overlap=workload == "llama-8")  # and multiplexed F/B graphs
    assert_matches_reference(plans, run_local_many(plans, OPTIONS))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "pp", "cp"),
    [("llama-8", 1, 1), pytest.param("nemotronh-16", 2, 1, marks=pytest.mark.extended), ("llama-8", 1, 2)],
)
def test_sequence_parallel_equals_the_reference(workload: str, pp: int, cp: int) -> None:
    # each tp rank holds 1/tp of the (context rank's) sequence between layers; norms, embedding, head and the
    # loss run on it, and the replicated parameters' gradients are averaged over the tp ranks after the step
    plans = split_plans(workload, pp=pp, tp=2, cp=cp, sp=True)
    runs = run_local_many(plans, OPTIONS)
    assert_matches_reference(plans, runs)


@pytest.mark.slow
def test_cp2_on_an_attention_stack_equals_the_reference() -> None:
    plans = split_plans("llama-8", pp=1, cp=2)
    assert_matches_reference(plans, run_local_many(plans, OPTIONS))


@pytest.mark.slow
@pytest.mark.extended  # 4 processes; tp and cp each are covered above
def test_pp2_cp2_and_tp2_cp2_equal_the_reference() -> None:
    for pp, tp in ((2, 1), (1, 2)):
        plans = split_plans("llama-8", pp=pp, tp=tp, cp=2)
        assert_matches_reference(plans, run_local_many(plans, OPTIONS))


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "tp", "cp"), [("nemotronh-16", 2, 1), ("llama-8", 1, 2)])
def test_fsdp_over_tensor_and_context_slices_equals_the_reference(workload: str, tp: int, cp: int) -> None:
    # dp=2 x tp=2 (x cp=2): each process's slices are FSDP-sharded over its dp group; the tp / cp collectives
    # stay in F and B, the parameters' move to UNSHARD / REDUCE_GRAD. Weights after AdamW are not compared:
    # a few weights whose gradient is ~1e-9 (rounding noise of an analytically zero sum: 7.6e-10 in the
    # reference, 1.1e-9 here, against a median of 8e-4) get AdamW steps of lr * g / (|g| + eps), which differ
    # by up to 3e-5; the losses of all 3 steps and every gradient are compared at fp32 tolerance.
    plans = split_plans(workload, pp=1, tp=tp, cp=cp, dp=2)
    assert_matches_reference(plans, run_local_many(plans, OPTIONS), params=False)


@pytest.mark.slow
@pytest.mark.extended  # another layer family
def test_moe_tp2_losses_and_gradients_equal_the_reference() -> None:
    # weights after AdamW are not compared: expert weights whose gradient is ~1e-9 (rounding noise, tokens
    # rarely routed there) get AdamW steps of either sign in both runs; loss and gradients are what TP changes
    plans = split_plans("moe-ep-4", pp=2, tp=2)[:1]
    assert_matches_reference(plans, run_local_many(plans, OPTIONS), params=False)


def _one_line_refusal(plan: plan_pb2.Plan, expected: str) -> None:
    with pytest.raises(ValueError) as caught:
        run_local_many([plan], OPTIONS)
    message = str(caught.value)
    assert expected in message and "\n" not in message, message


def test_a_mesh_the_model_cannot_take_is_refused_in_one_line_before_any_rank_starts() -> None:
    plan = split_plans("llama-8", pp=1, tp=3)[0]  # tiny llama: 4 heads
    _one_line_refusal(plan, "mesh tp=3 does not divide the model's heads=4: choose a tp that divides 4")
    plan = split_plans("llama-8", pp=1, cp=3)[0]  # sequence 8
    _one_line_refusal(plan, "mesh cp=3 does not divide the sequence length 8")
    plan = split_plans("nemotronh-16", pp=1, cp=2)[0]
    _one_line_refusal(plan, "Mamba layer(s), whose scan needs the whole sequence in order: use cp=1")
    plan = split_plans("llama-8", pp=1, tp=4, cp=4, sp=True)[0]  # cp = 4 divides 8, cp x tp = 16 does not
    _one_line_refusal(plan, "sequence parallelism splits the sequence of 8 over cp x tp = 16 ranks")
    plan = split_plans("llama-8", pp=1, tp=1, sp=True)[0]
    with pytest.raises(PlanError, match="sequence_parallel splits the sequence over the tp ranks, but tp=1"):
        run_local_many([plan], OPTIONS)
    plan = split_plans("moe-ep-4", pp=1, tp=2)[0]
    plan.mesh.dp = plan.mesh.ep = 2
    _one_line_refusal(with_collectives(plan), "expert parallelism (ep=2) with tp or cp > 1 is not supported")


def test_check_mesh_model_names_what_does_not_divide() -> None:
    plan = split_plans("llama-8", pp=2, tp=2)[0]
    spec = mesh_spec(plan)
    check_mesh_model(spec, {"heads": 4, "ffn": 48, "sequence": 8})
    for facts, words in (
        ({"heads": 6, "mamba_heads": 3}, "mamba_heads=3"),
        ({"heads": 4, "mlp_ffn": 7}, "mlp_ffn=7"),
    ):
        with pytest.raises(PlanError, match=words):
            check_mesh_model(spec, facts)


def test_the_mesh_lays_tensor_ranks_innermost() -> None:
    plan = split_plans("llama-8", pp=2, tp=2, cp=2)[0]
    plan.mesh.dp = 3
    spec = mesh_spec(plan)
    assert spec.world_size == 24 and spec.shape == "pp=2 x dp=3 x cp=2 x tp=2"
    assert spec.global_rank(1, 2, 1, 0) == ((1 * 3 + 2) * 2 + 1) * 2
    assert spec.position(23) == MeshCoord(pp=1, dp=2, cp=1, tp=1)
    assert spec.tp_group(0, 1, 1) == (6, 7)
    assert spec.cp_group(1, 0, 1) == (13, 15)
    assert spec.peers(7) == {0: 7, 1: 19}  # the same (replica, context, tensor rank) on every pipeline rank
    del plan.mesh.global_ranks[:]
    plan.mesh.global_ranks.extend(range(23))
    with pytest.raises(PlanError, match="needs 24"):
        mesh_spec(plan)


def _collectives(graph: torch.fx.GraphModule) -> list[str]:
    return [COLLECTIVE_KINDS[str(getattr(packet(n), "__name__", ""))] for n in graph.graph.nodes if is_collective(n)]


def _graph_placement(rank: int, world: int, split: str) -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2)
    built = build_model(reference)
    tokens, _ = built.batch(0)
    names = built.model.pipeline_layers()  # type: ignore[operator]
    stages = split_model(built.model, [names[:2], [names[2]], names[3:]])
    with torch.no_grad():
        hidden = stages[0](tokens if split == "tp" else tokens.chunk(world, 1)[rank])  # sp and cp: a slice
    stage = stages[1]
    if split == "cp":
        context_parallel(stage, default_group())
    else:
        tensor_parallel(stage, default_group(), sequence_parallel=split == "sp")
    compiled = compile_stage(stage, [hidden])
    assert compiled.split is not None
    forward, backward_input = _collectives(compiled.graphs.forward), _collectives(compiled.split.backward_input)
    if split == "tp":  # attention and MLP: one all-reduce each way (Megatron's g forward, f backward)
        assert forward == ["all_reduce", "all_reduce"] and backward_input == ["all_reduce", "all_reduce"]
    elif split == "sp":  # the sequence gathered in, reduce-scattered out, per layer; the reverse in B
        assert forward == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
        assert sorted(backward_input) == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    else:  # keys and values gathered forward, their gradients reduce-scattered in B
        assert forward == ["all_gather", "all_gather"]
        assert sorted(backward_input) == ["reduce_scatter", "reduce_scatter"]
    assert _collectives(compiled.split.backward_weight) == []


@pytest.mark.parametrize("split", ["tp", "sp", "cp"])
def test_collectives_land_in_the_forward_and_input_gradient_graphs(split: str) -> None:
    run_ranks(_graph_placement, 2, split)


def _vocabulary_split(rank: int, world: int) -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2)
    built = build_model(reference)
    tokens, targets = built.batch(0)
    names = built.model.pipeline_layers()  # type: ignore[operator]
    stages = split_model(built.model, [names[:-1], names[-1:]])
    with torch.no_grad():
        hidden = stages[0](tokens)
        expected = stages[1](hidden, targets)  # the whole head and the model's own loss
    specs = split_stage(stages[1], built.model, default_group(), sequence_parallel=False)
    assert sorted(specs) == ["head.proj.weight"] and specs["head.proj.weight"].dim == 0
    compiled = compile_stage(stages[1], [hidden, targets])
    assert compiled.split is not None
    # forward: the cross-entropy's max, sum of exponentials and target logit; backward: the head's input gradient
    assert _collectives(compiled.graphs.forward) == ["all_reduce"] * 3
    assert _collectives(compiled.split.backward_input) == ["all_reduce"]
    loss, _ = compiled.forward([hidden, targets])
    torch.testing.assert_close(loss, expected)  # the same loss from the vocabulary slices
    first = split_stage(stages[0], built.model, default_group(), sequence_parallel=False)
    assert "embed.weight" in first and first["embed.weight"].shape == (64, 32)


def test_embedding_and_head_split_by_vocabulary_compute_the_models_loss() -> None:
    run_ranks(_vocabulary_split, 2)


@pytest.mark.slow
def test_clipping_counts_every_slice_once_and_replicated_weights_once() -> None:
    # tp=2 x cp=2 with sequence parallelism: a sliced weight's norm is the sum of its slices' squares, a
    # replicated one (norms) is counted by tensor and context rank 0 only; the clipped run equals the reference
    tight = Optimization(clip_grad_norm=0.05)
    plan = split_plans("llama-8", pp=1, tp=2, cp=2, sp=True)[0]
    run = run_local_many(
        [plan], RunOptions(steps=3, keep_params=True, timeout_s=180, pin_cores=False, optimization=tight)
    )[0]
    ref = reference_run(plan.model, num_microbatches=M, steps=3, optimization=tight)
    assert all(n > 0.05 for n in ref.grad_norms)  # every step clips
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
    assert run.losses == pytest.approx(ref.losses, rel=1e-6)
    assert_tensors_close(plan.name, "param", ref.params, run.params)
