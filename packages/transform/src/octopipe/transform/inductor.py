"""Compiled stages: each split graph (F, fused B, I, W) handed to Inductor, with its calling convention kept.

The stage compiler captures and splits a stage into aten graphs; with
``backend="inductor"`` it then compiles each of them on its own
(:func:`compile_stage_graphs`). A compiled graph takes and returns exactly
what its eager graph does: the same inputs, the same outputs in the same
order. So what F saves for I and W, and I stashes for W, is the same set of
tensors (the same count, shapes and dtypes: checked when a graph is
compiled), and the memory the simulator plans with still holds. What is
compiled is a copy of each graph module whose ``forward`` calls the compiled
code; its ``graph`` is the eager graph, so passes that read graphs (FLOP
counts, multiplexing, the FSDP split) see what they always saw.

Example inputs come from each placeholder's traced metadata (shape, stride,
dtype), filled with zeros: Inductor specialises on them, and the shapes are
the ones the stage runs with. Inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default one folder per user under the system
temp dir) is shared by every process of the machine: the ranks and the
profiler compile a graph once.

Not compiled: the multiplexed OVERLAP_F_B graphs and the FSDP UNSHARD /
REDUCE_GRAD graphs (collectives), which run eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import fx

from octopipe.capture import StageGraphs
from octopipe.transform.bw_split import BWSplit

__all__ = ["BACKENDS", "Backend", "CompileError", "compile_graph", "compile_stage_graphs", "stage_backend"]

Backend = Literal["eager", "inductor"]
#: the stage backends a run may name
BACKENDS: tuple[Backend, ...] = ("eager", "inductor")


def stage_backend(name: str) -> Backend:
    """``name`` as a :data:`Backend`; ValueError naming the choices otherwise."""
    for backend in BACKENDS:
        if name == backend:
            return backend
    raise ValueError(f"compile must be one of {', '.join(BACKENDS)}, got {name!r}")


class CompileError(RuntimeError):
    """A graph failed to compile; the message names the stage and the graph."""


def _example(node: fx.Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise CompileError(f"placeholder {node.name!r} carries no traced tensor ('val'): cannot compile the graph")
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).zero_()


def compile_graph(graph: fx.GraphModule, what: str) -> fx.GraphModule:
    """``graph`` compiled by Inductor, as a graph module with the same graph and calling convention.

    Raises :class:`CompileError` naming ``what`` (the stage and graph) if Inductor fails, or if the
    compiled code does not return the eager graph's outputs (count, shapes, dtypes) on the example inputs.
    """
    from torch._inductor import compile as inductor_compile  # noqa: PLC0415 (imports the compiler stack)

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    try:
        example: list[Any] = [_example(n) for n in placeholders]
        compiled = inductor_compile(graph, example)
        got = compiled(*example)
    except CompileError as exc:
        raise CompileError(f"{what}: {exc}") from exc
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"{what}: Inductor failed ({type(exc).__name__}: {first})") from exc
    expected = graph(*example)
    got_list = list(got) if isinstance(got, (list, tuple)) else [got]
    expected_list = list(expected) if isinstance(expected, (list, tuple)) else [expected]

    def spec(values: Sequence[Any]) -> list[object]:
        return [None if v is None else (tuple(v.shape), v.dtype) for v in values]

    if spec(got_list) != spec(expected_list):
        raise CompileError(
            f"{what}: the compiled graph returns {spec(got_list)}, the eager graph {spec(expected_list)}: "
            "not the same tensors, so memory planning would not hold; run this stage eagerly"
        )
    module = fx.GraphModule(graph, graph.graph)
    # an instance attribute: calls run the compiled code (GraphModule keeps its generated forward on the class)
    module.forward = compiled
    return module


def compile_stage_graphs(
    graphs: StageGraphs, split: BWSplit, *, stage_index: int, fallback: bool = False
) -> tuple[StageGraphs, BWSplit]:
    """F, the fused backward, I and W of one stage compiled by Inductor (see the module doc).

    A graph that fails raises :class:`CompileError` naming the stage and graph; with ``fallback`` it
    stays eager instead (and a warning says which).
    """
    import warnings  # noqa: PLC0415

    def one(graph: fx.GraphModule, name: str) -> fx.GraphModule:
        try:
            return compile_graph(graph, f"stage {stage_index}, graph {name}")
        except CompileError as exc:
            if not fallback:
                raise
            warnings.warn(f"{exc}; running it eagerly (fallback asked for)", stacklevel=3)
            return graph

    compiled_graphs = dataclasses.replace(
        graphs, forward=one(graphs.forward, "F"), backward=one(graphs.backward, "B (fused backward)")
    )
    compiled_split = dataclasses.replace(
        split,
        backward_input=one(split.backward_input, "I (input gradient)"),
        backward_weight=one(split.backward_weight, "W (weight gradient)"),
    )
    return compiled_graphs, compiled_split
