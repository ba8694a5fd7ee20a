"""One stage compiler: the profiler times the graphs the runtime runs, and nothing else compiles stages.

The profiler (``pipeline.profile_reference``) and the worker (``runtime.rank_stages``) each compile
through a ``transform.StageCompiler``; for a plan with one layer per stage, every stage's F, fused
backward, B and W graphs must be the same code in both. A second test keeps the runtime and the
profiler from growing their own capture or split calls again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from octopipe.execute.runtime import build_model, workload_reference
from octopipe.execute.runtime.mesh import MeshRank
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.execute.runtime.stages import rank_stages
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import CompiledStage, StageCompiler, compile_stage
from octopipe.tune import one_f_one_b

ROOT = Path(__file__).resolve().parents[2]


def _codes(stage: CompiledStage) -> dict[str, str]:
    return {
        "F": stage.graphs.forward.code,
        "fused backward": stage.graphs.backward.code,
        "B": stage.split.backward_input.code,
        "W": stage.split.backward_weight.code,
    }


def _runtime_graphs(reference: plan_pb2.ModelReference, names: list[str], m: int) -> list[CompiledStage]:
    """Compile every stage of a one-layer-per-stage plan as the worker does (all stages, as if every rank)."""
    plan = one_f_one_b(len(names), m, layer_names=[[name] for name in names])
    plan.model.CopyFrom(reference)
    compiler = StageCompiler()
    mesh = MeshRank.create(plan, 0, len(plan.ranks))  # no mesh: no process group is needed
    rank_stages(plan, build_model(plan.model), list(range(len(names))), mesh, compiler)
    return list(compiler.compiled.values())


@pytest.mark.parametrize(
    "reference",
    [
        workload_reference("llama-8", tiny=True, sequence=8, global_batch=4),
        plan_pb2.ModelReference(
            name="llama", source="tests.execute.hf_sources:llama", config={"tied": "false", "layers": "2"}
        ),
    ],
    ids=["layer-list llama", "whole-model llama"],
)
def test_the_profiler_times_the_graphs_the_runtime_runs(reference: plan_pb2.ModelReference) -> None:
    m = 2
    profiler = StageCompiler()
    profile = profile_reference(reference, num_microbatches=m, repeats=1, compiler=profiler)
    names = [layer.layer_name for layer in profile.layers]
    timed = list(profiler.compiled.values())
    run = _runtime_graphs(reference, names, m)
    assert len(timed) == len(run) == len(names) >= 3
    for index, (profiled, ran) in enumerate(zip(timed, run, strict=True)):
        assert _codes(profiled) == _codes(ran), f"layer {names[index]}: the profiler timed other graphs"


def test_a_compiler_reuses_a_stage_by_key_and_multiplexes_a_pair_once() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    compiler = StageCompiler()
    first = compiler.compile(layer, [x], stage_index=1, key="a")
    assert compiler.compile(layer, [x], stage_index=1, key="a") is first
    assert compiler.compile(layer, [x], stage_index=1) is not first  # no key: not cached
    exe = first.bind(layer)
    again = compile_stage(layer, [x], stage_index=1)
    assert exe.graphs.forward.code == again.graphs.forward.code
    one = compiler.overlap(exe, exe, "full")
    two = compiler.overlap(exe, exe, "full")
    assert one.multiplexed is two.multiplexed
    assert compiler.overlap(exe, exe, "input").multiplexed is not one.multiplexed
    with pytest.raises(ValueError, match="'full' or 'input'"):
        compiler.overlap(exe, exe, "fused")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without sharded parameters"):
        compiler.compile(layer, [x], stage_index=1, key="a").bind_sharded(layer)


#: calls that compile a stage; only the stage compiler (and the passes themselves) may make them
_COMPILING = {"capture_stage", "split_backward", "split_fsdp", "multiplex", "OverlapStage", "compile_fsdp_stage"}


def test_the_runtime_and_the_profiler_compile_only_through_the_stage_compiler() -> None:
    files = [
        *sorted((ROOT / "packages/execute/src/octopipe/execute").rglob("*.py")),
        ROOT / "packages/transform/src/octopipe/transform/profiler.py",
    ]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in _COMPILING:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
    assert not found, "compile stages with transform.StageCompiler instead:\n" + "\n".join(found)
