"""Compiled stages (``RunOptions(compile="inductor")``): each stage's F, B, I and W graphs compiled by Inductor.

2 gloo ranks, every zoo workload (tiny) and HF Llama, 1F1B, ZB-H1 and ZB-V (and DualPipeV's OVERLAP_F_B
graphs on the MoE): losses and every gradient after one step, and every weight after three SGD steps,
equal the single-process eager reference within the stated fp32 tolerance (``COMPILED_TOLERANCE``:
Inductor fuses and reorders arithmetic, so not bitwise); and two compiled runs equal each other bitwise
(deterministic code on one thread per rank). Structural tests: a compiled graph keeps its eager
calling convention (what F saves for I and W is the same set of tensors), and a graph Inductor cannot
compile is named, or runs eagerly only when asked. On the expert-parallel MoE (2 gloo ranks): a graph
with all-to-alls, and a multiplexed OVERLAP_F_B graph, is compiled between its collectives, which run
eagerly in the eager graph's order.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from octopipe.capture import split_model
from octopipe.execute.runs import STAGE_BACKENDS
from octopipe.execute.runtime import RunOptions, build_model, reference_run, run_local_many, workload_reference
from octopipe.execute.runtime.pipeline import layer_names
from octopipe.execute.training import Optimization
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.transform import (
    BACKENDS,
    COMPILED_TOLERANCE,
    CompileError,
    StageCompiler,
    compiled_tolerance,
    stage_backend,
)
from octopipe.transform.collectives import is_collective
from octopipe.transform.inductor import compile_graph
from octopipe.tune import dualpipe_v, equal_partition, one_f_one_b, zb_h1, zb_v
from tests.execute.test_cli import OCTOPIPE
from tests.transform.gloo import run_ranks
from tests.transform.test_multiplex import ep_moe_stage

M = 4


def test_the_backends_are_named_alike_in_the_control_plane() -> None:
    assert STAGE_BACKENDS == BACKENDS
    with pytest.raises(ValueError, match="compile must be one of eager, inductor"):
        stage_backend("tensorrt")
    with pytest.raises(ValueError, match="compile must be one of"):
        RunOptions(compile="tensorrt")


@pytest.mark.slow
@pytest.mark.extended  # 10-30 s of Inductor compiling on a cold cache (CI's budget); one decoder layer
def test_a_compiled_stage_keeps_every_graphs_calling_convention() -> None:
    torch.manual_seed(0)
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2)
    built = build_model(reference)
    names = built.model.pipeline_layers()  # type: ignore[operator]
    stages = split_model(built.model, [names[:1], names[1:2], names[2:]])
    tokens, _ = built.batch(0)
    hidden = stages[0](tokens[:1]).detach()
    eager = StageCompiler().compile(stages[1], [hidden], stage_index=1)
    compiled = StageCompiler(backend="inductor").compile(stages[1], [hidden], stage_index=1)
    for name in ("forward", "backward"):
        a, b = getattr(eager.graphs, name), getattr(compiled.graphs, name)
        assert str(a.graph) == str(b.graph)  # passes that read graphs see the eager graph
        assert a.forward is not b.forward
    exe_e, exe_c = eager.bind(stages[1]), compiled.bind(stages[1])
    out_e, ctx_e = exe_e.forward([hidden])
    out_c, ctx_c = exe_c.forward([hidden])
    saved_e, saved_c = ctx_e.saved or [], ctx_c.saved or []
    assert [(t.shape, t.dtype) for t in saved_e] == [(t.shape, t.dtype) for t in saved_c]
    torch.testing.assert_close(out_c, out_e)
    grad = torch.randn_like(out_e)
    input_e, wctx_e = exe_e.backward_input(ctx_e, grad)
    input_c, wctx_c = exe_c.backward_input(ctx_c, grad)
    assert [(t.shape, t.dtype) for t in wctx_e.tensors or []] == [(t.shape, t.dtype) for t in wctx_c.tensors or []]
    torch.testing.assert_close(input_c[0], input_e[0])
    for a, b in zip(exe_c.backward_weight(wctx_c), exe_e.backward_weight(wctx_e), strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b)


def test_a_graph_inductor_cannot_compile_is_named() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")  # no traced metadata: nothing to compile it for
    graph.output((graph.call_function(torch.ops.aten.relu.default, (x,)),))
    module = fx.GraphModule({}, graph)
    with pytest.raises(CompileError, match=r"stage 3, graph W: .*no traced tensor"):
        compile_graph(module, "stage 3, graph W")


@pytest.mark.extended  # 16 s: Inductor and the C++ compiler start on a cold cache (CI's budget)
def test_a_compiled_graph_takes_its_inputs_in_any_layout_and_states_its_tolerance() -> None:
    """Inductor's code is specialised on the traced strides; an input laid out otherwise (a boundary tensor
    received contiguous where the sender's output was a view) is put in the traced layout first."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(x @ w).sum(-1),)

    traced_x = torch.randn(6, 4).t()  # traced as a transposed view: strides (1, 4)
    graph = make_fx(fn, tracing_mode="fake")(traced_x, torch.randn(6, 3))
    compiled = compile_graph(graph, "stage 0, graph F")
    x, w = torch.randn(4, 6), torch.randn(6, 3)  # contiguous: strides (6, 1)
    assert x.stride() != traced_x.stride()
    torch.testing.assert_close(compiled(x, w)[0], graph(x, w)[0])
    assert compiled_tolerance(torch.float32) == COMPILED_TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match=r"no stated tolerance for compiled torch\.int64"):
        compiled_tolerance(torch.int64)


def _collectives(graph: fx.Graph) -> list[tuple[object, tuple[int, ...]]]:
    return [(n.target, tuple(n.meta["val"].shape)) for n in graph.nodes if is_collective(n)]


def _segments(graph: fx.GraphModule) -> fx.GraphModule:
    runner = graph.get_submodule("segments")  # compile_segments keeps its top-level graph here
    assert isinstance(runner, fx.GraphModule)
    return runner


def _close(actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b)


def _compiled_ep_moe(rank: int, world: int) -> None:
    stage, x0, x1, grad = ep_moe_stage(rank)
    eager, inductor = StageCompiler(), StageCompiler(backend="inductor")
    exe_e = eager.executable(stage, [x0], stage_index=1)
    exe_c = inductor.executable(stage, [x0], stage_index=1)
    graphs = {"F": exe_c.graphs.forward, "I": exe_c.split.backward_input, "B": exe_c.graphs.backward}
    for name, graph in graphs.items():
        runner = _segments(graph)  # the compiled segments and, between them, the eager collectives
        assert len(_collectives(graph.graph)) == 4, name  # dispatch + combine of 2 layers
        assert _collectives(runner.graph) == _collectives(graph.graph), name
        assert sum(n.op == "call_module" for n in runner.graph.nodes) >= 3, name
    out_e, ctx_e = exe_e.forward([x0])
    out_c, ctx_c = exe_c.forward([x0])
    torch.testing.assert_close(out_c, out_e)
    input_e, wctx_e = exe_e.backward_input(ctx_e, grad)
    input_c, wctx_c = exe_c.backward_input(ctx_c, grad)
    _close(input_c, input_e)
    _close(exe_c.backward_weight(wctx_c), exe_e.backward_weight(wctx_e))
    kinds: tuple[Literal["full", "input"], ...] = ("full", "input")
    for kind in kinds:
        over_e, over_c = eager.overlap(exe_e, exe_e, kind), inductor.overlap(exe_c, exe_c, kind)
        # the multiplexer's collective order (what is in flight beside which compute) survives compiling
        merged = _segments(over_c.multiplexed.graph)
        assert _collectives(merged.graph) == _collectives(over_e.multiplexed.graph.graph), kind
        _, ctx1_e = exe_e.forward([x1])
        _, ctx1_c = exe_c.forward([x1])
        got, want = over_c.run([x0], ctx1_c, grad), over_e.run([x0], ctx1_e, grad)
        torch.testing.assert_close(got.output, want.output)
        _close(got.input_grads, want.input_grads)
        if kind == "full":
            assert got.param_grads is not None and want.param_grads is not None
            _close(got.param_grads, want.param_grads)
        else:
            assert got.weight_ctx is not None and want.weight_ctx is not None
            _close(exe_c.backward_weight(got.weight_ctx), exe_e.backward_weight(want.weight_ctx))


@pytest.mark.slow
@pytest.mark.extended  # compiles a MoE stage's graphs and two multiplexed graphs on each of 2 ranks
def test_graphs_with_collectives_compile_between_them_and_keep_their_order() -> None:
    run_ranks(_compiled_ep_moe, 2)


#: every zoo workload (tiny) and HF Llama (transformers, captured whole: the numerics guard checks the compiled
#: stages against the model's own ops at the compiled tolerance)
MODELS = ["llama-8", "jamba-8", "nemotronh-16", "moe-ep-4", "hf-llama"]


def _reference(model: str) -> plan_pb2.ModelReference:
    if model == "hf-llama":
        return plan_pb2.ModelReference(
            name="llama", source="tests.execute.hf_sources:llama", config={"global_batch": str(M), "sequence": "8"}
        )
    return workload_reference(model, tiny=True, sequence=8, global_batch=M)


def _plans(model: str) -> list[plan_pb2.Plan]:
    reference = _reference(model)
    names = layer_names(reference)
    plans = [
        one_f_one_b(2, M, layer_names=equal_partition(names, 2)),
        zb_h1(2, M, layer_names=equal_partition(names, 2)),
        zb_v(2, M, layer_names=equal_partition(names, 4)),
    ]
    if model == "moe-ep-4":  # and the multiplexed OVERLAP_F_B graphs, compiled
        plans.append(dualpipe_v(2, M, layer_names=equal_partition(names, 4)))
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


def _compiled_sgd(steps: int) -> tuple[Optimization, RunOptions]:
    """Compiled runs with plain SGD (learning rate 0.5, no decay) that keep their gradients and weights."""
    optimization = Optimization(optimizer="sgd", learning_rate=0.5, weight_decay=0.0)
    options = RunOptions(
        steps=steps,
        keep_grads=True,
        keep_params=True,
        timeout_s=900,
        pin_cores=False,
        compile="inductor",
        optimization=optimization,
    )
    return optimization, options


@pytest.mark.slow
@pytest.mark.extended  # compiles each model's stages (cached on disk after the first run): 1-4 min a model
@pytest.mark.parametrize("model", MODELS)
def test_compiled_runs_equal_the_eager_reference_and_each_other_bitwise(model: str) -> None:
    plans = _plans(model)
    # SGD, not AdamW: the weights after 3 steps fold in steps 2 and 3's gradients, and SGD carries a gradient's
    # rounding through at its size. AdamW divides by sqrt(v): for a weight whose gradient is near 0 it turns a
    # rounding-level difference into one of up to the learning rate (seen: 3e-5 on one MoE weight of 6144)
    optimization, options = _compiled_sgd(steps=3)
    first = run_local_many(plans, options)
    second = run_local_many(plans, options)
    ref = reference_run(plans[0].model, num_microbatches=M, steps=3, optimization=optimization)
    atol, rtol = compiled_tolerance(torch.float32)
    for plan, run, again in zip(plans, first, second, strict=True):
        assert run.losses == again.losses, plan.name  # deterministic: bitwise between runs
        for name, value in run.grads.items():
            assert torch.equal(value, again.grads[name]), (plan.name, name)
        for name, value in run.params.items():
            assert torch.equal(value, again.params[name]), (plan.name, name)
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), atol=atol, rtol=rtol)
        for what, expected, actual in (("grad", ref.grads, run.grads), ("param", ref.params, run.params)):
            assert sorted(actual) == sorted(expected), plan.name
            for name, value in expected.items():
                torch.testing.assert_close(
                    actual[name],
                    value,
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, n=name, w=what, p=plan.name: f"{p}: {w} {n}: {m}",  # type: ignore[misc]
                )


@pytest.mark.slow
@pytest.mark.extended  # compiles every layer of the tiny model (cached on disk after the first run)
def test_the_profiler_times_the_compiled_graphs(tmp_path: Path) -> None:
    """`octopipe profile --compile inductor`: the tuner plans with the costs of the graphs that will run."""
    out = tmp_path / "profile.binpb"
    command = [*OCTOPIPE, "profile", "--workload", "llama-8", "--tiny", "--sequence", "8", "--repeats", "1"]
    result = subprocess.run(
        [*command, "--compile", "inductor", "--out", str(out)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    profile = profile_pb2.Profile.FromString(out.read_bytes())
    assert profile.labels["compile"] == "inductor"
    assert len(profile.layers) == 10 and all(layer.forward_duration_us > 0 for layer in profile.layers)


@pytest.mark.slow
@pytest.mark.extended  # compiles the bf16 graphs of the tiny llama-8 (cached on disk after the first run)
def test_a_compiled_bf16_pipeline_is_as_accurate_as_the_bf16_eager_reference() -> None:
    """bf16 parameters and activations (float32 masters and gradient accumulation), 1F1B and ZB-V, 2 SGD steps.

    Losses within the stated bf16 tolerance of the bf16 eager reference. Gradients and weights: bf16 sums of
    many rounded terms cancel, so an element of two bf16 computations may differ by 100% (seen: 8% of the
    embedding's gradient outside rtol 1.6e-2). What holds per tensor is accuracy: the compiled run's distance
    from the float32 reference is at most 1.25x the bf16 eager reference's (Inductor computes a fused chain
    of bf16 ops in float32 and rounds once, so it is usually closer).
    """
    plans = _plans("llama-8")
    for plan in plans:
        plan.precision.compute_dtype = "bfloat16"
    optimization, options = _compiled_sgd(steps=2)
    runs = run_local_many([plans[0], plans[2]], options)
    bf16 = reference_run(plans[0].model, num_microbatches=M, steps=2, optimization=optimization, dtype=torch.bfloat16)
    fp32 = reference_run(plans[0].model, num_microbatches=M, steps=2, optimization=optimization)
    atol, rtol = compiled_tolerance(torch.bfloat16)
    for run in runs:
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(bf16.losses), atol=atol, rtol=rtol)
        for what in ("grads", "params"):
            compiled, eager, exact = getattr(run, what), getattr(bf16, what), getattr(fp32, what)
            assert sorted(compiled) == sorted(eager) == sorted(exact)
            for name, value in compiled.items():
                assert value.dtype == torch.float32, name  # float32 accumulation and masters
                ours = float((value - exact[name]).norm())
                theirs = float((eager[name] - exact[name]).norm())
                assert ours <= 1.25 * theirs + atol * value.numel() ** 0.5, (what, name, ours, theirs)
