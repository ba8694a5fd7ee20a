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
import operator
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
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


def _example(value: object, name: str) -> Any:
    """Zeros shaped like a traced value: a tensor, or a tuple of them (an op with several results)."""
    if isinstance(value, (tuple, list)):
        return tuple(_example(v, name) for v in value)
    if not isinstance(value, torch.Tensor):
        raise CompileError(f"placeholder {name!r} carries no traced tensor ('val'): cannot compile the graph")
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).zero_()


def _flat(graph: fx.GraphModule) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """A copy of ``graph`` with flat tensor inputs and one flat tuple of outputs, and the outputs' structure.

    Inductor takes and returns flat lists of tensors. A split graph may return, or take, a node whose
    value is a tuple (an op with several results stashed from I for W): such an input becomes one
    placeholder per element (its ``getitem`` uses read them), such an output one output per element;
    the returned structure rebuilds the eager graph's outputs, and callers pass ``tree_leaves(args)``.
    """
    copy = fx.Graph()
    env: dict[fx.Node, Any] = {}
    output = None
    for node in graph.graph.nodes:
        if node.op == "output":
            output = node
            continue
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, (tuple, list)):
            parts = []
            for index, element in enumerate(value):
                part = copy.placeholder(f"{node.name}_{index}")
                part.meta["val"] = element
                parts.append(part)
            env[node] = tuple(parts)
            continue
        if node.op == "call_function" and node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        if isinstance(env.get(node), tuple) or any(isinstance(env.get(i), tuple) for i in node.all_input_nodes):
            raise CompileError(f"node {node.name!r} reads a tuple input other than by index: not handled")
        env[node] = copy.node_copy(node, lambda n: env[n])

    def expand(item: Any) -> Any:  # a tuple-valued node as a tuple of its elements
        if isinstance(item, fx.Node):
            value = item.meta.get("val")
            mapped = env[item]
            if isinstance(mapped, tuple):
                return mapped
            if isinstance(value, (tuple, list)):
                parts = []
                for index, element in enumerate(value):
                    part = copy.call_function(operator.getitem, (mapped, index))
                    part.meta["val"] = element
                    parts.append(part)
                return tuple(parts)
            return mapped
        return item

    assert output is not None
    structure = pytree.tree_map_only(fx.Node, expand, output.args[0])
    leaves, spec = pytree.tree_flatten(structure)
    copy.output(tuple(leaves))
    return fx.GraphModule(graph, copy), spec


def compile_graph(graph: fx.GraphModule, what: str) -> fx.GraphModule:
    """``graph`` compiled by Inductor, as a graph module with the same graph and calling convention.

    Raises :class:`CompileError` naming ``what`` (the stage and graph) if Inductor fails, or if the
    compiled code does not return the eager graph's outputs (count, shapes, dtypes) on the example inputs.
    """
    from torch._inductor import compile as inductor_compile  # noqa: PLC0415 (imports the compiler stack)

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    try:
        flat, structure = _flat(graph)
        example: list[Any] = [_example(n.meta.get("val"), n.name) for n in placeholders]
        compiled_flat = inductor_compile(flat, pytree.tree_leaves(example))

        def compiled(*args: Any) -> Any:  # the eager graph's inputs and (possibly nested) outputs
            return pytree.tree_unflatten(list(compiled_flat(*pytree.tree_leaves(args))), structure)

        got = compiled(*example)
    except CompileError as exc:
        raise CompileError(f"{what}: {exc}") from exc
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"{what}: Inductor failed ({type(exc).__name__}: {first})") from exc
    expected = graph(*example)
    got_list = pytree.tree_leaves(got)
    expected_list = pytree.tree_leaves(expected)

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
