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

A graph that holds collectives (an MoE dispatch or combine under expert
parallelism, or a multiplexed OVERLAP_F_B graph of such stages) is compiled
in segments (:func:`compile_segments`): each run of compute between two
collectives is one compiled graph, and the collectives and their waits run
eagerly between them, in the graph's order. So the order the multiplexer
chose (what is in flight while which compute runs) is kept, every rank issues
its collectives in that order, and compiling issues no collective. The FSDP
UNSHARD and REDUCE_GRAD graphs (collectives alone) run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import fx

from octopipe.capture import StageGraphs
from octopipe.transform.bw_split import BWSplit, _subgraph  # a run of nodes as a graph, as the B/W split cuts one
from octopipe.transform.collectives import is_collective, is_wait
from octopipe.transform.compile_cache import CompileIndex, GraphTiming, graph_key, time_graphs

__all__ = [
    "BACKENDS",
    "COMPILED_TOLERANCE",
    "Backend",
    "CompileError",
    "auto_stage_graphs",
    "compile_graph",
    "compile_segments",
    "compile_stage_graphs",
    "compiled_tolerance",
    "stage_backend",
]

Backend = Literal["eager", "inductor", "auto"]
#: the stage backends a run may name: as captured, compiled, or compiled where the compile cache says it is
#: warm and faster (``compile_cache``)
BACKENDS: tuple[Backend, ...] = ("eager", "inductor", "auto")


#: how far a compiled graph's results may be from its eager graph's, by dtype: (atol, rtol), torch.testing's
#: defaults. Inductor fuses and reorders arithmetic (a sum in another order, a fused multiply-add), so results
#: agree to rounding, not bitwise. The numerics guard checks compiled stages' outputs with them; the tests hold
#: float32 losses, gradients and weights to them elementwise, and bf16 losses (a bf16 gradient is a sum of many
#: rounded terms that cancel: there the tests require the compiled run to be as close to float32 as eager bf16).
COMPILED_TOLERANCE: Mapping[torch.dtype, tuple[float, float]] = MappingProxyType(
    {
        torch.float64: (1e-7, 1e-7),
        torch.float32: (1e-5, 1.3e-6),
        torch.bfloat16: (1e-5, 1.6e-2),
        torch.float16: (1e-5, 1e-3),
    }
)


def compiled_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for compiled results of ``dtype`` (:data:`COMPILED_TOLERANCE`); ValueError for others."""
    if dtype not in COMPILED_TOLERANCE:
        raise ValueError(f"no stated tolerance for compiled {dtype}: use one of {sorted(map(str, COMPILED_TOLERANCE))}")
    return COMPILED_TOLERANCE[dtype]


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


@contextlib.contextmanager
def _cacheable() -> Iterator[None]:
    """A tracing context with a shape environment around an Inductor compile.

    Inductor's on-disk FX graph cache keys a graph with the shape environment of the tracing context, and
    bypasses itself when there is none ("No shape env"): outside torch.compile there is none, so without
    this every graph is lowered and generated again in every process (a Mamba block: 100 s, warm or cold).
    The shapes are static; the environment holds no symbols.
    """
    from torch._guards import TracingContext, tracing  # noqa: PLC0415
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
        yield


def _as_traced(value: Any, stride: tuple[int, ...]) -> Any:
    """``value`` in the layout the graph was traced with (a copy only when its strides differ).

    Inductor's code is specialised on its inputs' strides and checks them. An eager graph takes any
    layout, and a value may arrive in another one than traced: a boundary tensor received contiguous
    where the sender's output was a view, or an activation laid out differently by a compiled producer.
    """
    if not isinstance(value, torch.Tensor) or value.stride() == stride:
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


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


def _communicates(node: fx.Node) -> bool:
    return is_collective(node) or is_wait(node)


def compile_graph(graph: fx.GraphModule, what: str) -> fx.GraphModule:
    """``graph`` compiled by Inductor, as a graph module with the same graph and calling convention.

    A graph with collectives is compiled in segments (:func:`compile_segments`). Raises
    :class:`CompileError` naming ``what`` (the stage and graph) if Inductor fails, or if the compiled
    code does not return the eager graph's outputs (count, shapes, dtypes) on the example inputs.
    """
    if any(_communicates(node) for node in graph.graph.nodes):
        return compile_segments(graph, what)
    return _compile_whole(graph, what)


def _compile_whole(graph: fx.GraphModule, what: str) -> fx.GraphModule:
    from torch._inductor import compile as inductor_compile  # noqa: PLC0415 (imports the compiler stack)

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    try:
        flat, structure = _flat(graph)
        example: list[Any] = [_example(n.meta.get("val"), n.name) for n in placeholders]
        with _cacheable():
            compiled_flat = inductor_compile(flat, pytree.tree_leaves(example))

        strides = [v.stride() for v in pytree.tree_leaves(example)]

        def compiled(*args: Any) -> Any:  # the eager graph's inputs and (possibly nested) outputs
            leaves = [_as_traced(v, stride) for v, stride in zip(pytree.tree_leaves(args), strides, strict=True)]
            return pytree.tree_unflatten(list(compiled_flat(*leaves)), structure)

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


def compile_segments(graph: fx.GraphModule, what: str) -> fx.GraphModule:
    """``graph`` with each maximal run of compute between collectives compiled on its own.

    The collectives and their ``wait_tensor`` calls stay in the top-level graph, eager and in their
    order; a segment takes the values it reads from before it and returns those read after it. The
    returned module has ``graph``'s graph and calling convention, like :func:`compile_graph`'s.
    """
    body = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[list[fx.Node]] = []
    for node in body:
        if _communicates(node):
            runs.append([node])
        elif runs and not _communicates(runs[-1][0]):
            runs[-1].append(node)
        else:
            runs.append([node])
    top = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            env[node] = top.node_copy(node)
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    segments = 0
    for index, run in enumerate(runs):
        if _communicates(run[0]):
            env[run[0]] = top.node_copy(run[0], lambda n: env[n])
            continue
        inside = set(run)
        later = {n for later_run in runs[index + 1 :] for n in later_run} | {output}
        reads = list(dict.fromkeys(i for n in run for i in n.all_input_nodes if i not in inside))
        results = [n for n in run if any(user in later for user in n.users)]
        name = f"segment_{segments}"
        root.add_module(
            name, compile_graph(_subgraph(graph, set(run), reads, list(results)), f"{what}, segment {segments}")
        )
        segments += 1
        call = top.call_module(name, tuple(env[r] for r in reads))
        for position, result in enumerate(results):
            env[result] = top.call_function(operator.getitem, (call, position))
            env[result].meta = dict(result.meta)
    top.output(fx.map_arg(output.args[0], lambda n: env[n]))
    runner = fx.GraphModule(root, top)
    module = fx.GraphModule(graph, graph.graph)
    module.forward = runner.forward  # the segments and collectives; ``graph`` stays the eager graph
    module.segments = runner  # keeps the compiled segments reachable (and inspectable)
    return module


def _examples(graph: fx.GraphModule) -> list[Any]:
    return [_example(n.meta.get("val"), n.name) for n in graph.graph.nodes if n.op == "placeholder"]


#: a stage's four graphs, by the names the notes and errors use
_GRAPH_NAMES = ("F", "B (fused backward)", "I (input gradient)", "W (weight gradient)")


def _stage_parts(graphs: StageGraphs, split: BWSplit) -> list[fx.GraphModule]:
    return [graphs.forward, graphs.backward, split.backward_input, split.backward_weight]


def _rebuild(graphs: StageGraphs, split: BWSplit, parts: list[fx.GraphModule]) -> tuple[StageGraphs, BWSplit]:
    forward, backward, backward_input, backward_weight = parts
    return (
        dataclasses.replace(graphs, forward=forward, backward=backward),
        dataclasses.replace(split, backward_input=backward_input, backward_weight=backward_weight),
    )


def compile_stage_graphs(
    graphs: StageGraphs,
    split: BWSplit,
    *,
    stage_index: int,
    fallback: bool = False,
    index: CompileIndex | None = None,
) -> tuple[StageGraphs, BWSplit]:
    """F, the fused backward, I and W of one stage compiled by Inductor (see the module doc).

    A graph that fails raises :class:`CompileError` naming the stage and graph; with ``fallback`` it
    stays eager instead (and a warning says which). With ``index``, each compiled graph's compile time
    and its compiled and eager times on the example inputs are recorded there (``compile_cache``), so
    ``backend="auto"`` can use it later.
    """
    import warnings  # noqa: PLC0415

    def one(graph: fx.GraphModule, name: str) -> fx.GraphModule:
        what = f"stage {stage_index}, graph {name}"
        started = time.monotonic()
        try:
            compiled = compile_graph(graph, what)
        except CompileError as exc:
            if not fallback:
                raise
            warnings.warn(f"{exc}; running it eagerly (fallback asked for)", stacklevel=3)
            return graph
        # a graph with collectives is never timed here (running it alone would post collectives its peers do
        # not): it stays out of the index, so ``auto`` runs its stage as captured
        if index is not None and not any(_communicates(node) for node in graph.graph.nodes):
            seconds = time.monotonic() - started
            eager_us, compiled_us = time_graphs(graph, compiled, _examples(graph))
            index.put(graph_key(graph), GraphTiming(what, eager_us, compiled_us, seconds, torch.__version__))
        return compiled

    parts = [one(graph, name) for graph, name in zip(_stage_parts(graphs, split), _GRAPH_NAMES, strict=True)]
    return _rebuild(graphs, split, parts)


def auto_stage_graphs(
    graphs: StageGraphs, split: BWSplit, *, stage_index: int, index: CompileIndex
) -> tuple[StageGraphs, BWSplit, str, int]:
    """``backend="auto"``: the stage's graphs compiled where ``index`` has seen all four before (Inductor's
    cache is warm) and only those that ran faster compiled; otherwise as captured. A graph that fails to
    compile runs eagerly with a warning naming it. Returns the graphs, one line saying what runs, and how
    many graphs run compiled."""
    import warnings  # noqa: PLC0415

    parts = _stage_parts(graphs, split)
    timings = [index.get(graph_key(graph)) for graph in parts]
    unseen = sum(t is None for t in timings)
    if unseen:
        return graphs, split, f"stage {stage_index}: as captured (compile cache cold: {unseen} of 4 graphs unseen)", 0
    chosen, compiled_names, slower, failed = [], [], [], []
    for graph, name, timing in zip(parts, _GRAPH_NAMES, timings, strict=True):
        assert timing is not None
        short = name.split(" ")[0]
        if not timing.faster:
            chosen.append(graph)
            slower.append(short)
            continue
        try:
            chosen.append(compile_graph(graph, f"stage {stage_index}, graph {name}"))
            compiled_names.append(short)
        except CompileError as exc:
            warnings.warn(f"{exc}; running it eagerly (compile auto)", stacklevel=3)
            chosen.append(graph)
            failed.append(short)
    graphs, split = _rebuild(graphs, split, chosen)
    note = f"stage {stage_index}: compiled {', '.join(compiled_names) or 'nothing'}"
    if slower:
        note += f"; as captured (faster so): {', '.join(slower)}"
    if failed:
        note += f"; as captured (failed to compile): {', '.join(failed)}"
    return graphs, split, note, len(compiled_names)
