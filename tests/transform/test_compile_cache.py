"""``backend="auto"``: a stage's graphs run compiled only where the compile index has seen all of them (Inductor's
cache is warm) and only those that ran faster compiled; a cold index runs the stage as captured, bitwise; a graph
that fails to compile runs eagerly with a warning that names it (transform.compile_cache, transform.inductor)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from octopipe.transform import CompileIndex, GraphTiming, StageCompiler, StageExecutable, graph_key


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


def _stage() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Block(), torch.randn(4, 16)


def _step(exe: StageExecutable, x: torch.Tensor) -> list[torch.Tensor]:
    """F, I and W of one micro-batch: the output, the input gradient and every weight gradient."""
    out, ctx = exe.forward([x])
    grads, wctx = exe.backward_input(ctx, torch.ones_like(out))
    return [out, *(g for g in grads if g is not None), *(g for g in exe.backward_weight(wctx) if g is not None)]


def _parts(exe: StageExecutable) -> list[torch.fx.GraphModule]:
    return [exe.graphs.forward, exe.graphs.backward, exe.split.backward_input, exe.split.backward_weight]


def _compiled(graph: torch.fx.GraphModule) -> bool:
    """Whether calls run compiled code (a compiled graph module carries its own ``forward``)."""
    return "forward" in vars(graph)


def test_a_cold_index_runs_the_stage_as_captured_bitwise(tmp_path: Path) -> None:
    stage, x = _stage()
    eager = StageCompiler().executable(stage, [x], stage_index=1)
    compiler = StageCompiler(backend="auto", index=CompileIndex(tmp_path))
    auto = compiler.executable(stage, [x], stage_index=1)
    assert not any(_compiled(g) for g in _parts(auto))
    assert compiler.notes[1] == "stage 1: as captured (compile cache cold: 4 of 4 graphs unseen)"
    assert not compiler.compiled_stages
    for a, b in zip(_step(auto, x), _step(eager, x), strict=True):
        assert torch.equal(a, b)


def test_compiling_fills_the_index_and_auto_then_compiles_only_the_faster_graphs(tmp_path: Path) -> None:
    stage, x = _stage()
    index = CompileIndex(tmp_path)
    StageCompiler(backend="inductor", index=index).executable(stage, [x], stage_index=1)
    eager = StageCompiler().executable(stage, [x], stage_index=1)
    keys = [graph_key(g) for g in _parts(eager)]
    timings = [index.get(key) for key in keys]
    assert all(t is not None and t.eager_us > 0 and t.compiled_us > 0 and t.compile_s > 0 for t in timings)
    assert [t.what for t in timings if t is not None] == [
        "stage 1, graph F",
        "stage 1, graph B (fused backward)",
        "stage 1, graph I (input gradient)",
        "stage 1, graph W (weight gradient)",
    ]
    # what the index says decides, whatever this machine measured: F and I faster compiled, B and W not
    for key, timing, faster in zip(keys, timings, (True, False, True, False), strict=True):
        assert timing is not None
        index.put(key, dataclasses.replace(timing, eager_us=100.0, compiled_us=50.0 if faster else 99.0))
    compiler = StageCompiler(backend="auto", index=index)
    auto = compiler.executable(stage, [x], stage_index=1)
    assert [_compiled(g) for g in _parts(auto)] == [True, False, True, False]
    assert compiler.notes[1] == "stage 1: compiled F, I; as captured (faster so): B, W"
    assert compiler.compiled_stages == {1}
    for a, b in zip(_step(auto, x), _step(eager, x), strict=True):
        torch.testing.assert_close(a, b)  # compiled code agrees to rounding (COMPILED_TOLERANCE)


def test_a_graph_that_fails_to_compile_runs_eagerly_with_a_named_warning(tmp_path: Path) -> None:
    stage, x = _stage()
    compiler = StageCompiler()
    compiled = compiler.compile(stage, [x], stage_index=2)
    # a W graph that cannot be compiled: its inputs carry no traced metadata (as test_compiled_stages builds one)
    broken = compiled.split.backward_weight
    for node in broken.graph.nodes:
        if node.op == "placeholder":
            node.meta.pop("val", None)
    index = CompileIndex(tmp_path)
    for graph in (compiled.graphs.forward, compiled.graphs.backward, compiled.split.backward_input, broken):
        index.put(graph_key(graph), GraphTiming("a graph", 100.0, 10.0 if graph is broken else 200.0, 1.0, "any"))
    from octopipe.transform.inductor import auto_stage_graphs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs, split, note, count = auto_stage_graphs(compiled.graphs, compiled.split, stage_index=2, index=index)
    assert count == 0 and split.backward_weight is broken and graphs.forward is compiled.graphs.forward
    assert note == "stage 2: compiled nothing; as captured (faster so): F, B, I; as captured (failed to compile): W"
    messages = [str(w.message) for w in caught]
    assert any("stage 2, graph W (weight gradient)" in m and "running it eagerly (compile auto)" in m for m in messages)


def test_the_index_refuses_nothing_it_cannot_read(tmp_path: Path) -> None:
    index = CompileIndex(tmp_path)
    assert index.get("missing") is None
    (tmp_path / "broken.json").write_text("{not json")
    assert index.get("broken") is None
    timing = GraphTiming("stage 0, graph F", 2.0, 1.0, 0.5, torch.__version__)
    index.put("k", timing)
    assert index.get("k") == timing and timing.faster
    assert not list(tmp_path.glob("*.partial"))


def test_the_key_changes_with_what_decides_the_code() -> None:
    stage, x = _stage()
    a = StageCompiler().compile(stage, [x], stage_index=1).graphs.forward
    b = StageCompiler().compile(stage, [x[:2]], stage_index=1).graphs.forward  # another batch shape
    assert graph_key(a) == graph_key(StageCompiler().compile(stage, [x], stage_index=1).graphs.forward)
    assert graph_key(a) != graph_key(b)


def test_the_index_folder_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCTOPIPE_COMPILE_INDEX", str(tmp_path / "elsewhere"))
    assert CompileIndex().folder == tmp_path / "elsewhere"
