"""Compiled stages (``RunOptions(compile="inductor")``): each stage's F, B, I and W graphs compiled by Inductor.

2 gloo ranks, llama-8 tiny, 1F1B, ZB-H1 and ZB-V: losses and every gradient after one step, and every
weight after three AdamW steps, equal the single-process eager reference at fp32 tolerance (Inductor
fuses and reorders arithmetic, so not bitwise); and two compiled runs equal each other bitwise
(deterministic code on one thread per rank). Structural tests: a compiled graph keeps its eager
calling convention (what F saves for I and W is the same set of tensors), and a graph Inductor cannot
compile is named, or runs eagerly only when asked.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torch import fx

from octopipe.capture import split_model
from octopipe.execute.runs import STAGE_BACKENDS
from octopipe.execute.runtime import RunOptions, build_model, reference_run, run_local_many, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.transform import BACKENDS, CompileError, StageCompiler, stage_backend
from octopipe.transform.inductor import compile_graph
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v
from tests.execute.test_cli import OCTOPIPE

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


def _plans() -> list[plan_pb2.Plan]:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plans = [
        one_f_one_b(2, M, layer_names=equal_partition(names, 2)),
        zb_h1(2, M, layer_names=equal_partition(names, 2)),
        zb_v(2, M, layer_names=equal_partition(names, 4)),
    ]
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


@pytest.mark.slow
@pytest.mark.extended  # compiles 12 stages x 4 graphs (cached on disk after the first run)
def test_compiled_runs_equal_the_eager_reference_and_each_other_bitwise() -> None:
    plans = _plans()
    options = RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=600, pin_cores=False, compile="inductor")
    first = run_local_many(plans, options)
    second = run_local_many(plans, options)
    ref = reference_run(plans[0].model, num_microbatches=M, steps=3)
    for plan, run, again in zip(plans, first, second, strict=True):
        assert run.losses == again.losses, plan.name  # deterministic: bitwise between runs
        for name, value in run.grads.items():
            assert torch.equal(value, again.grads[name]), (plan.name, name)
        for name, value in run.params.items():
            assert torch.equal(value, again.params[name]), (plan.name, name)
        assert run.losses == pytest.approx(ref.losses, rel=1e-5), plan.name
        for what, expected, actual in (("grad", ref.grads, run.grads), ("param", ref.params, run.params)):
            assert sorted(actual) == sorted(expected), plan.name
            for name, value in expected.items():
                torch.testing.assert_close(
                    actual[name],
                    value,
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
