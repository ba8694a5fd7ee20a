"""Per-node cost estimates (microseconds) for scheduling and reporting overlap.

- :func:`roofline_costs`: from the shapes AOTAutograd records on every node
  (``meta["val"]``, or fx ``tensor_meta``): FLOPs of matmuls and attention at
  ``flops_per_us``, bytes moved by everything else at ``bytes_per_us``, views
  free; a collective costs ``latency + bytes sent / bandwidth``. A pure
  function of the graph, so every rank gets the same numbers for the same graphs.
- :func:`profile_costs`: the same estimate, scaled so each graph sums to what a
  Profile measured for its layers (LayerCost F, B, W), with collectives priced
  by the Profile's LinkCost (latency, bandwidth).
- :func:`table_costs`: any per-node numbers, e.g. measured with
  :func:`measure_compute_us` (average them over ranks).
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx

from octopipe.profile.v1 import profile_pb2
from octopipe.transform.collectives import is_all_gather, is_all_to_all, is_collective, is_reduce_scatter, is_wait
from octopipe.transform.device import CPU, Device

__all__ = [
    "CostModel",
    "Roofline",
    "comm_bytes",
    "graph_flops",
    "measure_compute_us",
    "profile_costs",
    "roofline_costs",
    "table_costs",
]


@dataclass(kw_only=True, frozen=True)
class CostModel:
    """Per-node cost estimates in microseconds.

    ``compute_us(node)``: time on the compute stream (0 for views and
    bookkeeping); ``comm_us(node)``: transfer time of a collective issue
    node. Both are called with nodes of the graphs given to :func:`multiplex`.
    """

    compute_us: Callable[[fx.Node], float]
    comm_us: Callable[[fx.Node], float]


@dataclass(kw_only=True, frozen=True)
class Roofline:
    """Machine constants for :func:`roofline_costs`. Defaults: one CPU core, gloo on 127.0.0.1 (shared/facts.md)."""

    flops_per_us: float = 30_000.0
    bytes_per_us: float = 5_000.0
    link_latency_us: float = 100.0
    link_bytes_per_us: float = 3_000.0


def _specs(value: object) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor in a recorded value: FakeTensors (``val``) or fx ``TensorMetadata``."""
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _specs(v)]
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and isinstance(dtype, torch.dtype):
        return [(tuple(int(d) for d in shape), dtype)]
    return []


def _bytes(value: object) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in _specs(value))


def _val(node: fx.Node) -> object:
    return node.meta.get("val", node.meta.get("tensor_meta"))


def _flops(node: fx.Node) -> float | None:
    name = str(node.target).removeprefix("aten.").split(".")[0]
    shapes = [shape for a in node.all_input_nodes for shape, _ in _specs(_val(a))]
    if name in ("mm", "addmm") and len(shapes) >= 2:
        (m, k), n = shapes[-2], shapes[-1][-1]
        return 2.0 * m * k * n
    if name in ("bmm", "baddbmm") and len(shapes) >= 2:
        (b, m, k), n = shapes[-2], shapes[-1][-1]
        return 2.0 * b * m * k * n
    if "scaled_dot_product" in name and shapes:
        batch, heads, seq, dim = shapes[0]
        return 4.0 * batch * heads * seq * seq * dim * (2.5 if "backward" in name else 1.0)
    return None


def graph_flops(graph: fx.GraphModule) -> float:
    """The floating-point operations of a graph's matrix multiplies and attention (``2mkn`` per matmul;
    elementwise work is not counted, as MFU conventionally counts it), from its nodes' shapes."""
    return sum(f for node in graph.graph.nodes if node.op == "call_function" and (f := _flops(node)) is not None)


def _free(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return True
    if getattr(node.target, "is_view", False):
        return True
    return str(node.target) in ("aten._unsafe_view.default", "aten.detach.default")


def comm_bytes(node: fx.Node) -> int:
    """Bytes one rank sends for a collective issue node (from its input's recorded shape; 0 if unknown)."""
    if not node.all_input_nodes:
        return 0
    size = _bytes(_val(node.all_input_nodes[0]))
    if is_all_to_all(node):
        splits = node.args[2] if len(node.args) > 2 else None
        world = len(splits) if isinstance(splits, (list, tuple)) and splits else 1
        return size * (world - 1) // max(1, world)
    if is_all_gather(node) or is_reduce_scatter(node):
        world = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else 1
        return size * (world - 1) if is_all_gather(node) else size * (world - 1) // max(1, world)
    return size


def _estimate_us(node: fx.Node, roofline: Roofline) -> float:
    if is_collective(node) or is_wait(node) or _free(node):
        return 0.0
    flops = _flops(node)
    moved = _bytes(_val(node)) + sum(_bytes(_val(a)) for a in node.all_input_nodes)
    memory = moved / roofline.bytes_per_us
    return max(memory, flops / roofline.flops_per_us) if flops is not None else memory


def roofline_costs(roofline: Roofline | None = None) -> CostModel:
    """Costs from recorded shapes alone (deterministic: every rank gets the same numbers for the same graphs)."""
    r = roofline or Roofline()

    def comm_us(node: fx.Node) -> float:
        return r.link_latency_us + comm_bytes(node) / r.link_bytes_per_us

    return CostModel(compute_us=lambda node: _estimate_us(node, r), comm_us=comm_us)


def table_costs(
    compute_us: Mapping[fx.Node, float], comm_us: Mapping[fx.Node, float], *, fallback: CostModel | None = None
) -> CostModel:
    """Costs from per-node tables; nodes missing from a table are priced by ``fallback`` (default: roofline)."""
    rest = fallback or roofline_costs()
    return CostModel(
        compute_us=lambda n: compute_us[n] if n in compute_us else rest.compute_us(n),
        comm_us=lambda n: comm_us[n] if n in comm_us else rest.comm_us(n),
    )


def _scaled(graph: fx.GraphModule, total_us: float, roofline: Roofline) -> dict[fx.Node, float]:
    raw = {n: _estimate_us(n, roofline) for n in graph.graph.nodes if n.op not in ("placeholder", "output")}
    scale = total_us / sum(raw.values()) if sum(raw.values()) > 0 else 0.0
    return {n: v * scale for n, v in raw.items()}


def profile_costs(
    profile: profile_pb2.Profile,
    *,
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    forward_layers: Iterable[str],
    backward_layers: Iterable[str],
    backward_kind: Literal["full", "input", "weight"] = "full",
    rank: int = 0,
) -> CostModel:
    """Costs calibrated to a Profile: each graph's nodes sum to its layers' measured time.

    ``forward`` is priced to the sum of the forward layers' F time;
    ``backward`` to the backward layers' full backward (``full``: the
    measured fused time, else B + W), B (``input``) or W (``weight``) time.
    Collectives use the mean latency and bandwidth of the Profile's links out
    of ``rank`` (all links if none starts there).
    """
    layers = {c.layer_name: c for c in profile.layers}
    wanted = [*forward_layers], [*backward_layers]
    unknown = sorted(set(wanted[0] + wanted[1]) - set(layers))
    if unknown:
        raise ValueError(f"the profile has no costs for layers {unknown}: profile the model these graphs come from")

    def backward_us(c: profile_pb2.LayerCost) -> float:
        if backward_kind == "input":
            return c.backward_input_duration_us
        if backward_kind == "weight":
            return c.backward_weight_duration_us
        if c.HasField("full_backward_duration_us"):
            return c.full_backward_duration_us
        return c.backward_input_duration_us + c.backward_weight_duration_us

    links = [link for link in profile.links if link.source_rank == rank] or list(profile.links)
    if not links:
        raise ValueError(
            "the profile has no links: measure them (octopipe.execute.runtime.linkprobe) to price collectives"
        )
    latency = statistics.fmean(link.latency_us for link in links)
    bandwidth = statistics.fmean(link.bandwidth_bytes_per_second for link in links) / 1e6
    if bandwidth <= 0:
        raise ValueError("the profile's links have no bandwidth: re-measure them")
    roofline = Roofline(link_latency_us=latency, link_bytes_per_us=bandwidth)
    table = _scaled(forward, sum(layers[n].forward_duration_us for n in wanted[0]), roofline)
    table |= _scaled(backward, sum(backward_us(layers[n]) for n in wanted[1]), roofline)
    return table_costs(table, {}, fallback=roofline_costs(roofline))


def measure_compute_us(
    graph: fx.GraphModule, args: Sequence[object], *, repeats: int = 3, device: Device = CPU
) -> dict[fx.Node, float]:
    """Median time of every compute node of ``graph`` over ``repeats`` runs (an fx Interpreter), on
    ``device``'s clock (:class:`~octopipe.transform.device.Stopwatch`: CUDA events on a GPU).

    Collectives run for real, so every rank of their group must call this
    with the same graph at the same time; average the result over ranks
    before building a schedule from it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[fx.Node, list[float]] = {}
    spans: list[tuple[fx.Node, int]] = []  # (node, index of its start mark; its end is the next mark)

    class Timer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            timed = n.op not in ("placeholder", "output") and not (is_collective(n) or is_wait(n))
            if timed:
                spans.append((n, len(watch.host)))
                watch.mark()
            result = super().run_node(n)
            if timed:
                watch.mark()
            return result

    with torch.no_grad():
        for _ in range(repeats):
            watch = device.stopwatch()
            spans.clear()
            Timer(graph).run(*args)
            times = watch.device_ns()
            for n, index in spans:
                samples.setdefault(n, []).append((times[index + 1] - times[index]) / 1000.0)
    return {n: statistics.median(v) for n, v in samples.items()}
