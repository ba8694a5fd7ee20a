"""Recomputation per stage (``CaptureConfig.recompute``, the plan's ``Stage.recompute``): bitwise equal to saving.

Every zoo workload and a transformers family, captured stage by stage with each policy and the B/W split:
the loss and every gradient equal those of saving everything, bit for bit, while the forward keeps fewer
bytes for the backward. Then real gloo ranks run ZB-H1 and ZB-V with a different policy on each stage,
bitwise equal to the single-process eager reference after AdamW steps.
"""

from __future__ import annotations

import pytest
import torch

from octopipe.capture import CaptureConfig, CaptureError, capture_stage, pipeline_spec, trace_model
from octopipe.execute.runtime import RunOptions, build_model, reference_run, run_local_many, workload_reference
from octopipe.execute.runtime.pipeline import compare, layer_names, profile_reference
from octopipe.execute.runtime.stages import capture_config
from octopipe.ir import PlanError, Recompute, recompute_of, validate_plan, with_recompute
from octopipe.simulate import local_cost_model, simulate
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v
from tests.capture.whole_model import assert_bitwise, run_graph_split
from tests.hf_models import FAMILIES
from tests.pipeline_reference import Result, run_split

POLICIES = [
    CaptureConfig(recompute="layers"),
    CaptureConfig(recompute="budget", activation_budget=0.5),
    CaptureConfig(recompute="budget", activation_budget=0.0),
]


def saved_bytes(result: Result) -> list[int]:
    """The bytes each stage's forward keeps for its backward (parameters included), from the graphs' metadata."""
    out = []
    for exe in result.stages:
        outputs = next(n for n in reversed(exe.graphs.forward.graph.nodes) if n.op == "output").args[0]
        saved = outputs[exe.graphs.num_outputs :]
        out.append(sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in saved))
    return out


def same(a: Result, b: Result) -> None:
    assert torch.equal(a.loss, b.loss)
    assert_bitwise(a.grads, b.grads)
    for x, y in zip(a.input_grads, b.input_grads, strict=True):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert torch.equal(x, y)


@pytest.mark.parametrize("workload", ["llama-8", "jamba-8", "nemotronh-16", "moe-ep-4"])
def test_every_policy_on_every_zoo_workload_is_bitwise_and_saves_less(workload: str) -> None:
    model = build_model(workload_reference(workload, tiny=True, sequence=16, global_batch=2)).model
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    names = pipeline_spec(model).names
    partition = [names[: len(names) // 2], names[len(names) // 2 :]]
    base = run_split(model, partition, inputs, targets, seed=0)
    base_bytes = saved_bytes(base)
    # CI's budget: budget 0.0 runs in the ZB-V test below, the fused backward on the smallest model
    for config in POLICIES[:2]:
        result = run_split(model, partition, inputs, targets, seed=0, config=config)
        same(base, result)
        kept = saved_bytes(result)
        assert all(k < b for k, b in zip(kept, base_bytes, strict=True)), (config, kept, base_bytes)
    if workload == "llama-8":
        same(base, run_split(model, partition, inputs, targets, seed=0, fused=True, config=POLICIES[0]))


def test_a_transformers_family_recomputes_its_layers_bitwise() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = FAMILIES["qwen3"]("sdpa")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    graph = trace_model(model, inputs)
    names = list(graph.layers)
    partition = [names[: len(names) // 2], names[len(names) // 2 :]]
    base = run_graph_split(graph, partition, inputs, fused=False)
    for config in POLICIES[:2]:
        result = run_graph_split(graph, partition, inputs, fused=False, config=config)
        assert torch.equal(result.loss, base.loss)
        assert_bitwise(base.grads, result.grads)
        base_saved = [e.graphs.num_saved for e in base.executables]
        assert [e.graphs.num_saved for e in result.executables] != base_saved


def test_layers_policy_needs_a_stage_that_knows_its_layers() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with pytest.raises(CaptureError, match="recompute='layers' needs a stage that knows its layers"):
        capture_stage(plain, [torch.randn(2, 4)], config=CaptureConfig(recompute="layers", route="direct"))
    capture_stage(plain, [torch.randn(2, 4)], config=CaptureConfig(recompute="budget", activation_budget=0.2))


def test_bad_policies_are_refused_at_every_boundary() -> None:
    with pytest.raises(ValueError, match="recompute must be one of"):
        CaptureConfig(recompute="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        CaptureConfig(recompute="budget", activation_budget=1.5)
    with pytest.raises(ValueError, match="only with recompute='budget'"):
        CaptureConfig(recompute="layers", activation_budget=0.5)
    with pytest.raises(ValueError, match="write none, layers or budget:F"):
        Recompute.parse("selective")
    with pytest.raises(ValueError, match="budget:F"):
        Recompute.parse("budget:2")
    plan = zb_h1(2, 4, layer_names=[["a"], ["b"]])
    plan = with_recompute(plan, {0: Recompute.parse("budget:0.25"), 1: Recompute.parse("layers")})
    assert [recompute_of(s).label for s in plan.stages] == ["budget:0.25", "layers"]
    validate_plan(plan)
    plan.stages[1].recompute.activation_budget = 0.5
    with pytest.raises(PlanError, match="stage 1: recompute activation_budget is set but the policy is not BUDGET"):
        validate_plan(plan)
    plan.stages[1].ClearField("recompute")
    plan.stages[0].recompute.activation_budget = -0.5
    with pytest.raises(PlanError, match=r"stage 0: recompute activation_budget -0.5 is not in \[0, 1\]"):
        validate_plan(plan)
    assert capture_config(plan.stages[1], None) is None


@pytest.mark.slow
def test_zero_bubble_schedules_with_a_policy_per_stage_equal_the_reference_bitwise() -> None:
    ranks, m = 2, 4
    reference = workload_reference("jamba-8", tiny=True, sequence=8, global_batch=2 * m)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    h1 = zb_h1(ranks, m, layer_names=equal_partition(names, ranks))
    v = zb_v(ranks, m, layer_names=equal_partition(names, 2 * ranks))
    plans = [
        with_recompute(h1, {0: Recompute(policy="layers"), 1: Recompute(policy="budget", activation_budget=0.3)}),
        with_recompute(v, {0: Recompute(policy="layers"), 2: Recompute(policy="budget", activation_budget=0.0)}),
    ]
    for plan in plans:
        plan.model.CopyFrom(reference)
    runs = run_local_many(plans, RunOptions(steps=2, keep_grads=True, keep_params=True, timeout_s=120))
    ref = reference_run(reference, num_microbatches=m, steps=2)
    for plan, run in zip(plans, runs, strict=True):
        assert run.losses == ref.losses, plan.name
        assert_bitwise(ref.grads, run.grads)
        assert_bitwise(ref.params, run.params)


def test_the_simulator_reads_a_policy_from_the_profile_and_refuses_one_it_lacks() -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=16, global_batch=4)
    profile = profile_reference(reference, num_microbatches=2, repeats=1, recompute=[CaptureConfig(recompute="layers")])
    names = layer_names(reference)
    plan = one_f_one_b(2, 2, layer_names=equal_partition(names, 2))
    plan.model.CopyFrom(reference)
    for layer in profile.layers:
        assert [v.recompute for v in layer.recomputed] == ["layers"]
    saving = simulate(plan, local_cost_model(plan, profile)).estimate
    recomputing = with_recompute(plan, {0: Recompute(policy="layers"), 1: Recompute(policy="layers")})
    estimate = simulate(recomputing, local_cost_model(recomputing, profile)).estimate
    assert all(r.peak_memory_bytes < s.peak_memory_bytes for r, s in zip(estimate.ranks, saving.ranks, strict=True))
    budget = with_recompute(plan, {1: Recompute(policy="budget", activation_budget=0.5)})
    with pytest.raises(ValueError, match=r"not profiled with recompute policy 'budget:0.5' \(profiled: layers\)"):
        local_cost_model(budget, profile)


@pytest.mark.slow
def test_allocator_peak_under_recomputation_is_within_3_percent_of_the_prediction() -> None:
    """Standard-size llama-8 on 2 gloo ranks, 1F1B and ZB-H1 (whose first stage's W back-propagates the whole
    stage), every stage recomputing its layers: each rank's allocator peak against the simulator's peak from a
    profile taken with the policy."""
    m = 4
    reference = workload_reference("llama-8", global_batch=16)
    profile = profile_reference(reference, num_microbatches=m, repeats=1, recompute=[CaptureConfig(recompute="layers")])
    plans = []
    for schedule in (one_f_one_b, zb_h1):
        plan = schedule(2, m, layer_names=equal_partition(layer_names(reference), 2))
        plan.model.CopyFrom(reference)
        plans.append(with_recompute(plan, {0: Recompute(policy="layers"), 1: Recompute(policy="layers")}))
    runs = run_local_many(plans, RunOptions(steps=2, measure_memory=True, timeout_s=300))
    for plan, run in zip(plans, runs, strict=True):
        result = compare(plan, profile, [run])
        predicted = [r.peak_memory_bytes for r in result.simulation.estimate.ranks]
        measured = list(result.allocator_memory_bytes)
        errors = [abs(p - q) / q for p, q in zip(predicted, measured, strict=True)]
        assert max(errors) <= 0.03, (plan.name, predicted, measured, errors)
