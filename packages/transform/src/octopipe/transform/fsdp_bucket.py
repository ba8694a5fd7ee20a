"""Bucketed FSDP collectives: one all-gather and one reduce-scatter per bucket of parameters, not per parameter.

:func:`split_fsdp` leaves UNSHARD and REDUCE_GRAD with one collective per
parameter (what tracing the sharded module gives). Dozens of small
collectives cost far more than one large one (latency per call, and on
gloo a round trip each), and the simulator costs one collective per
bucket. :func:`bucket_collectives` rewrites both graphs, a pure function:

- **UNSHARD**: the per-parameter inputs of the all-gathers (each rank's
  padded shard, after any cast to the gather dtype) are flattened and
  concatenated into one buffer per bucket, gathered with one
  ``all_gather_into_tensor``; each parameter's gathered tensor is cut back
  out of the ``[world, bucket]`` result (a copy: rank r's piece of every
  parameter lies in row r) and goes on through the same unpad/view ops as
  before. The data moved is the same bytes, so the result is bitwise the
  per-parameter UNSHARD's.
- **REDUCE_GRAD**: each parameter's padded full gradient, seen as
  ``[world, n]`` (row r is what rank r keeps), is concatenated along dim 1
  into one ``[world, bucket]`` buffer, reduce-scattered once; rank r's row
  is cut into its parameters' shard gradients (views, no copy). Element by
  element the same values are summed over the same ranks; with two ranks
  the sum is bitwise the per-parameter one, with more the collective's ring
  may associate them in another order (fp32 rounding, the same as between
  two NCCL ring sizes).

A bucket holds consecutive collectives (graph order, which is parameter
order) of one group, dtype and reduce op, up to ``bucket_bytes`` of each
rank's shard in the collective's dtype (``None``: one bucket per stage and
dtype); with a gather dtype narrower than the reduce dtype, REDUCE_GRAD can
have more buckets than UNSHARD. Every rank of the
group compiles the same stage, so the buckets match across ranks.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
from torch import fx

from octopipe.transform.bw_split import _ancestors  # the same walk the B/W split makes
from octopipe.transform.collectives import is_all_gather, is_reduce_scatter, is_wait
from octopipe.transform.fsdp_split import FSDPGraphs

__all__ = ["BucketPolicy", "bucket_collectives", "count_collectives"]

_aten = torch.ops.aten
_functional = torch.ops._c10d_functional


@dataclass(kw_only=True, frozen=True)
class BucketPolicy:
    """How parameters are grouped into collectives: ``bucket_bytes`` of each rank's shard per bucket (None: a
    whole stage per bucket, one per dtype)."""

    bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(
                f"bucket_bytes must be positive (or None for one bucket per stage), got {self.bucket_bytes}"
            )


@dataclass(frozen=True, eq=False)
class _Collective:
    node: fx.Node
    wait: fx.Node
    source: fx.Node
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: tuple[object, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_bytes(self) -> int:
        """Bytes of one rank's part: the all-gather's input, or a reduce-scatter's output."""
        world = 1 if is_all_gather(self.node) else self.node.args[2]
        assert isinstance(world, int)
        return self.numel // world * self.dtype.itemsize


def _collectives(graph: fx.Graph, gather: bool) -> list[_Collective]:
    found = []
    for node in graph.nodes:
        if not (is_all_gather(node) if gather else is_reduce_scatter(node)):
            continue
        waits = [u for u in node.users if is_wait(u)]
        if len(waits) != 1 or len(node.users) != 1:
            raise ValueError(f"collective {node.name!r} is not followed by exactly one wait_tensor: cannot bucket it")
        source = node.args[0]
        assert isinstance(source, fx.Node)
        value = source.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"collective {node.name!r}: its input carries no tensor metadata ('val'): cannot bucket it"
            )
        key = (*node.args[1:], value.dtype)
        found.append(_Collective(node, waits[0], source, tuple(value.shape), value.dtype, key))
    return found


def _buckets(found: list[_Collective], policy: BucketPolicy) -> list[list[_Collective]]:
    buckets: list[list[_Collective]] = []
    open_: dict[tuple[object, ...], list[_Collective]] = {}
    for item in found:
        bucket = open_.get(item.key)
        limit = policy.bucket_bytes
        if bucket is not None and limit is not None and sum(c.shard_bytes for c in bucket) + item.shard_bytes > limit:
            bucket = None
        if bucket is None:
            bucket = open_[item.key] = []
            buckets.append(bucket)
        bucket.append(item)
    return buckets


def _call(graph: fx.Graph, target: object, *args: object) -> fx.Node:
    return graph.call_function(target, args)  # type: ignore[arg-type]


def _rewrite(source: fx.GraphModule, policy: BucketPolicy, gather: bool) -> fx.GraphModule:
    found = _collectives(source.graph, gather)
    if not found:
        return source
    buckets = _buckets(found, policy)
    moved = {n for c in found for n in (c.node, c.wait)}
    before = _ancestors([c.source for c in found])
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(source.graph.nodes)
    output = nodes[-1]
    for node in nodes:  # placeholders and everything that feeds a collective, in order
        if node.op == "placeholder" or (node in before and node not in moved):
            env[node] = graph.node_copy(node, lambda n: env[n])
    for bucket in buckets:
        world = bucket[0].node.args[2 if not gather else 1]
        assert isinstance(world, int)
        if gather:
            flat = _call(
                graph, _aten.cat.default, [_call(graph, _aten.reshape.default, env[c.source], [-1]) for c in bucket]
            )
            done = _call(
                graph,
                _functional.wait_tensor.default,
                _call(graph, _functional.all_gather_into_tensor.default, flat, *bucket[0].node.args[1:]),
            )
            rows = _call(graph, _aten.view.default, done, [world, -1])
            pieces = _call(graph, _aten.split_with_sizes.default, rows, [c.numel for c in bucket], 1)
            for index, c in enumerate(bucket):
                piece = _call(graph, operator.getitem, pieces, index)
                env[c.wait] = _call(graph, _aten.reshape.default, piece, [world * c.shape[0], *c.shape[1:]])
        else:
            parts = [_call(graph, _aten.reshape.default, env[c.source], [world, -1]) for c in bucket]
            flat = _call(graph, _aten.reshape.default, _call(graph, _aten.cat.default, parts, 1), [-1])
            done = _call(
                graph,
                _functional.wait_tensor.default,
                _call(graph, _functional.reduce_scatter_tensor.default, flat, *bucket[0].node.args[1:]),
            )
            pieces = _call(graph, _aten.split_with_sizes.default, done, [c.numel // world for c in bucket])
            for index, c in enumerate(bucket):
                piece = _call(graph, operator.getitem, pieces, index)
                env[c.wait] = _call(graph, _aten.view.default, piece, [c.shape[0] // world, *c.shape[1:]])
    for node in nodes:  # what comes after the collectives (unpad, view, cast), in order
        if node not in env and node not in moved and node is not output:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(fx.map_arg(output.args[0], lambda n: env[n]))
    graph.lint()
    return fx.GraphModule(source, graph)


def bucket_collectives(graphs: FSDPGraphs, policy: BucketPolicy | None = None) -> FSDPGraphs:
    """``graphs`` with UNSHARD and REDUCE_GRAD rewritten to one collective per bucket (see the module doc)."""
    policy = policy or BucketPolicy()
    return replace(
        graphs, unshard=_rewrite(graphs.unshard, policy, True), reduce_grad=_rewrite(graphs.reduce_grad, policy, False)
    )


def count_collectives(graph: fx.GraphModule) -> dict[str, int]:
    """How many all-gathers and reduce-scatters ``graph`` issues when it runs once."""
    nodes = list(graph.graph.nodes)
    return {
        "all_gather": sum(1 for n in nodes if is_all_gather(n)),
        "reduce_scatter": sum(1 for n in nodes if is_reduce_scatter(n)),
    }
