"""The FSDP collective split: UNSHARD and REDUCE_GRAD graphs out of a captured stage, so a schedule can place them.

A stage captured with sharded parameters (:func:`octopipe.transform.fsdp.shard_parameters`,
or any code that all-gathers with functional collectives) has, for every
parameter, an all-gather chain at the top of its forward graph and a
reduce-scatter tail at the end of its backward graph. :func:`split_fsdp` is a
pure function that moves them out:

- **UNSHARD** ``(*shards) -> (*full params)``: for each parameter placeholder,
  the ops that depend on nothing but that shard and only move or convert data
  (casts, views, flattening, slicing off the padding, cat/split) around
  exactly one ``all_gather_into_tensor`` and its ``wait_tensor``. It ends at
  the last node every use of the gathered parameter goes through, so the
  stage gets one full tensor per parameter.
- **F** then takes the full parameters where it took shards; B and W are
  split from the backward as usual, and **W returns full-size gradients** in
  the reduce dtype (the gradient just before any flatten/pad feeding the
  reduce-scatter, after the cast to the reduce dtype), so a runtime can sum
  them over micro-batches and reduce once per step.
- **REDUCE_GRAD** ``(*full grads) -> (*shard grads)``: for each parameter
  gradient, the tail of layout ops and scalings (a pre- or post-divide) around
  exactly one ``reduce_scatter_tensor`` and its ``wait_tensor``, plus casts
  after the reduce-scatter.

A parameter without an all-gather (not sharded) passes through both graphs
unchanged. Patterns that are recognised and refused with a ValueError
(see :data:`NOT_HANDLED`): a parameter gathered twice in one forward; a shard
used directly by compute; a gradient reduce-scattered more than once, or
combined with other values after the reduce-scatter; a backward that
all-gathers again (reshard-after-forward by recomputation); coalesced
(bucketed) collectives and all-reduce (DDP/HSDP replica dimensions).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from octopipe.capture import StageGraphs, live_nodes
from octopipe.transform.bw_split import BWSplit, split_backward
from octopipe.transform.collectives import (
    COLLECTIVE_KINDS,
    is_all_gather,
    is_cast,
    is_collective,
    is_layout,
    is_reduce_scatter,
    is_scale,
    is_wait,
    packet,
)
from octopipe.transform.executable import StageExecutable

__all__ = ["NOT_HANDLED", "FSDPGraphs", "FSDPStage", "ParamChain", "split_fsdp"]

#: what split_fsdp refuses (with a ValueError naming the parameter), in words
NOT_HANDLED = (
    "a parameter all-gathered more than once in one forward (read the parameter once per forward)",
    "a shard (or its cast) used by compute directly, not only through the all-gather",
    "a gradient reduce-scattered more than once, or added to other values after its reduce-scatter",
    "a backward that all-gathers again (reshard-after-forward by recomputation)",
    "coalesced/bucketed collectives (one all-gather or reduce-scatter for many parameters) and all-reduce "
    "over the parameters' group (collectives over other groups, e.g. tensor parallelism's, stay in F and B)",
    "gathers along a dimension other than 0 that need a transpose or permute to restore the layout",
)


@dataclass(frozen=True)
class ParamChain:
    """What moved for one parameter: the op names in its UNSHARD and REDUCE_GRAD parts (empty: passed through)."""

    name: str
    unshard_ops: tuple[str, ...]
    reduce_ops: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class FSDPGraphs:
    """UNSHARD, the stage without parameter collectives, and REDUCE_GRAD (see the module docstring).

    ``stage`` has the captured stage's calling convention, with full
    parameters in and full (unreduced) parameter gradients out.
    """

    unshard: fx.GraphModule
    stage: StageGraphs
    reduce_grad: fx.GraphModule
    chains: tuple[ParamChain, ...]


def group_of(node: fx.Node) -> str | None:
    """The process group name a functional collective (or the wait on one) runs over; None for other nodes."""
    if is_wait(node):
        source = node.args[0] if node.args else None
        return group_of(source) if isinstance(source, fx.Node) else None
    if not is_collective(node):
        return None
    name = node.kwargs.get("group_name", node.args[-1] if node.args else None)
    return name if isinstance(name, str) else None


def _parameter_collective(groups: Collection[str] | None) -> Callable[[fx.Node], bool]:
    """Whether a node is a parameter collective (or its wait): over one of ``groups``, or any with None."""

    def ours(node: fx.Node) -> bool:
        if not (is_collective(node) or is_wait(node)):
            return False
        return groups is None or group_of(node) in groups

    return ours


def _ancestors_within(node: fx.Node, region: set[fx.Node]) -> set[fx.Node]:
    seen = {node}
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent in region and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _op_name(node: fx.Node) -> str:
    """``view`` for aten.view.default, ``mul.Scalar``, ``wait_tensor`` for _c10d_functional.wait_tensor.default."""
    name = str(node.target).removesuffix(".default")
    return name.split(".", 1)[1] if name.startswith(("aten.", "_c10d_functional.", "prims.")) else name


def _names(nodes: Iterable[fx.Node], order: dict[fx.Node, int]) -> tuple[str, ...]:
    ops = [n for n in nodes if n.op == "call_function"]
    return tuple(_op_name(n) for n in sorted(ops, key=order.__getitem__))


def _unshard_region(
    name: str, shard: fx.Node, nodes: list[fx.Node], live: set[fx.Node], ours: Callable[[fx.Node], bool]
) -> tuple[set[fx.Node], fx.Node]:
    """The nodes UNSHARD takes for ``shard`` and the full parameter they produce (``shard`` itself if not gathered)."""
    region = {shard}
    for node in nodes:
        if node in live and node.op == "call_function" and node not in region:
            inputs = node.all_input_nodes
            movable = is_layout(node) or is_cast(node) or ((is_all_gather(node) or is_wait(node)) and ours(node))
            if movable and inputs and all(i in region for i in inputs):
                region.add(node)
    gathers = [n for n in region if is_all_gather(n)]
    if not gathers:
        return set(), shard
    if len(gathers) > 1:
        raise ValueError(
            f"parameter {name!r} is all-gathered {len(gathers)} times in one forward: read it once per forward "
            "(keep the full tensor in a local variable) so it has one UNSHARD"
        )
    boundary = [n for n in region if any(u not in region for u in n.users)]
    common = set.intersection(*(_ancestors_within(b, region) for b in boundary))
    index = {n: i for i, n in enumerate(nodes)}
    end = max(common, key=lambda n: index.get(n, -1))
    taken = _ancestors_within(end, region)
    if not any(is_wait(n) for n in taken):
        raise ValueError(
            f"parameter {name!r}: its shard (or a cast of it) is used by compute directly, not only through the "
            f"all-gather (node {end.name!r}); compute must use the gathered parameter"
        )
    return taken, end


def _reduce_tail(
    name: str, grad: fx.Node, nodes: list[fx.Node], output: fx.Node, ours: Callable[[fx.Node], bool]
) -> tuple[set[fx.Node], fx.Node]:
    """The nodes REDUCE_GRAD takes for one gradient output, and the full gradient entering them."""
    tail: set[fx.Node] = set()
    for node in reversed(nodes):
        collective = (is_reduce_scatter(node) or is_wait(node)) and ours(node)
        movable = is_layout(node) or is_cast(node) or is_scale(node) or collective
        if not movable:
            continue
        if (node is grad and all(u is output for u in node.users)) or (
            node is not grad and node.users and all(u in tail for u in node.users)
        ):
            tail.add(node)
    # an item of a multi-output op that stays (a convolution's weight gradient from convolution_backward) is
    # where the tail starts: the getitem stays with its op, so the tail is fed by a tensor, not a tuple
    for node in [n for n in tail if n.target is operator.getitem and n.all_input_nodes[0] not in tail]:
        tail.discard(node)
    scatters = [n for n in tail if is_reduce_scatter(n)]
    if not scatters:
        upstream = _ancestors_within(grad, set(nodes))
        if any(is_reduce_scatter(n) and ours(n) for n in upstream):
            raise ValueError(
                f"the gradient of parameter {name!r} is reduce-scattered, then combined with other values "
                f"(at {grad.name!r}): REDUCE_GRAD must be the gradient's last step; reduce once, after accumulating"
            )
        return set(), grad
    if len(scatters) > 1:
        raise ValueError(f"the gradient of parameter {name!r} is reduce-scattered {len(scatters)} times: not handled")
    # before the reduce-scatter only layout and scaling move: casts (to the reduce dtype) stay in W
    before = _ancestors_within(scatters[0], tail) - {scatters[0]}
    for node in [n for n in before if not (is_layout(n) or is_scale(n))]:
        tail -= _ancestors_within(node, tail)
    entries = {i for t in tail for i in t.all_input_nodes if i not in tail}
    if len(entries) != 1:
        raise ValueError(
            f"the reduce-scatter tail of parameter {name!r} reads {len(entries)} values ({sorted(e.name for e in entries)}); "
            "only a tail fed by the one full gradient is handled"
        )
    return tail, entries.pop()


def _copy(source: fx.Graph, keep: Callable[[fx.Node], bool], env: dict[fx.Node, fx.Node], graph: fx.Graph) -> None:
    for node in source.nodes:
        if node.op not in ("placeholder", "output") and keep(node) and node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])


def _placeholder(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node


def split_fsdp(graphs: StageGraphs, *, groups: Collection[str] | None = None) -> FSDPGraphs:
    """Move every parameter's all-gather chain into UNSHARD and its reduce-scatter tail into REDUCE_GRAD (pure).

    ``groups``: the names of the process groups parameters are sharded over; collectives over other groups
    (tensor- or context-parallel activations) stay where they are in the forward and backward. None: every
    collective is taken for a parameter collective."""
    fw, bw = graphs.forward, graphs.backward
    ours = _parameter_collective(groups)
    for node in [*fw.graph.nodes, *bw.graph.nodes]:
        kind = COLLECTIVE_KINDS.get(str(getattr(packet(node), "__name__", "")))
        if kind is not None and kind.endswith(("coalesced", "all_reduce")) and ours(node):
            raise ValueError(f"node {node.name!r} is a {kind}: coalesced collectives and all-reduce are not handled")
    if any(is_all_gather(n) and ours(n) for n in bw.graph.nodes):
        raise ValueError(
            "the backward graph all-gathers parameters again (reshard-after-forward by recomputation): not handled; "
            "capture with the default partitioner so the forward's gathered parameters are saved"
        )
    names = graphs.param_names
    fw_nodes = list(fw.graph.nodes)
    fw_index = {n: i for i, n in enumerate(fw_nodes)}
    placeholders = [n for n in fw_nodes if n.op == "placeholder"]
    live = live_nodes(fw.graph)
    regions = [
        _unshard_region(names[i], p, fw_nodes, live, ours) for i, p in enumerate(placeholders[: graphs.num_params])
    ]
    moved = set().union(*(r for r, _ in regions)) if regions else set()

    unshard = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: _placeholder(unshard, p.name, p) for p in placeholders[: graphs.num_params]}
    _copy(fw.graph, lambda n: n in moved, env, unshard)
    unshard.output(tuple(env[end] for _, end in regions))

    forward = fx.Graph()
    env = {end: _placeholder(forward, f"full_{i}", end) for i, (_, end) in enumerate(regions)}
    env.update({p: _placeholder(forward, p.name, p) for p in placeholders[graphs.num_params :]})
    for node in fw_nodes:
        if node not in moved and node.op != "output" and any(i in moved and i not in env for i in node.all_input_nodes):
            raise ValueError(f"forward node {node.name!r} reads an intermediate of an UNSHARD chain: not handled")
    _copy(fw.graph, lambda n: n not in moved, env, forward)
    fw_output = next(n for n in reversed(fw_nodes) if n.op == "output")
    forward.output(fx.map_arg(fw_output.args[0], lambda n: env[n]))

    bw_nodes = list(bw.graph.nodes)
    bw_index = {n: i for i, n in enumerate(bw_nodes)}
    bw_output = next(n for n in reversed(bw_nodes) if n.op == "output")
    grads = list(bw_output.args[0])
    tails = [
        _reduce_tail(names[i], g, bw_nodes, bw_output, ours) if isinstance(g, fx.Node) else (set(), None)
        for i, g in enumerate(grads[: graphs.num_params])
    ]
    removed = set().union(*(t for t, _ in tails)) if tails else set()
    backward = fx.Graph()
    env = {p: _placeholder(backward, p.name, p) for p in bw_nodes if p.op == "placeholder"}
    _copy(bw.graph, lambda n: n not in removed, env, backward)
    outputs = [env[entry] if entry is not None else None for _, entry in tails]
    outputs += [env[g] if isinstance(g, fx.Node) else None for g in grads[graphs.num_params :]]
    backward.output(tuple(outputs))

    reduce_grad = fx.Graph()
    env = {}
    for i, (_, entry) in enumerate(tails):
        like = entry if entry is not None else placeholders[i]
        holder = _placeholder(reduce_grad, f"grad_{i}", like)
        if entry is not None:
            env[entry] = holder
    _copy(bw.graph, lambda n: n in removed, env, reduce_grad)
    reduce_grad.output(tuple(env[g] if isinstance(g, fx.Node) else None for g in grads[: graphs.num_params]))

    chains = tuple(
        ParamChain(name=names[i], unshard_ops=_names(region, fw_index), reduce_ops=_names(tail, bw_index))
        for i, ((region, _), (tail, _)) in enumerate(zip(regions, tails, strict=True))
    )
    modules = [fx.GraphModule(fw, g) for g in (unshard, forward)] + [
        fx.GraphModule(bw, g) for g in (backward, reduce_grad)
    ]
    for module in modules:
        module.graph.lint()
    stage = replace(graphs, forward=modules[1], backward=modules[2])
    return FSDPGraphs(unshard=modules[0], stage=stage, reduce_grad=modules[3], chains=chains)


class FSDPStage:
    """A stage with sharded parameters: UNSHARD, then F/B/W on the full parameters, then REDUCE_GRAD.

    ``unshard()`` all-gathers (a collective: every rank of the group calls it
    at the same point of its schedule) and returns a :class:`StageExecutable`
    bound to the full parameters; dropping it is RESHARD. Its W (or fused
    backward) returns full gradients; sum them over micro-batches and call
    ``reduce_grad`` once per step to get this rank's gradient shards.
    """

    def __init__(
        self,
        graphs: FSDPGraphs,
        shards: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        *,
        split: BWSplit | None = None,
    ) -> None:
        if len(shards) != graphs.stage.num_params:
            raise ValueError(f"expected {graphs.stage.num_params} parameter shards, got {len(shards)}")
        self.graphs = graphs
        self.shards = [s.detach() for s in shards]
        self.buffers = [b.detach() for b in buffers]
        stage = graphs.stage
        self.split: BWSplit = split or split_backward(
            stage.backward, num_params=stage.num_params, num_inputs=stage.num_inputs
        )

    @classmethod
    def from_module(cls, stage: nn.Module, graphs: FSDPGraphs, *, split: BWSplit | None = None) -> FSDPStage:
        """Bind to ``stage``'s current shards and buffers (shared storage); ``split`` is the stage's B/W split
        when already made (``StageCompiler``), else it is made here."""
        params = dict(stage.named_parameters())
        buffers = dict(stage.named_buffers())
        return cls(
            graphs,
            [params[n] for n in graphs.stage.param_names],
            [buffers[n] for n in graphs.stage.buffer_names],
            split=split,
        )

    def unshard(self) -> StageExecutable:
        """UNSHARD: gather every parameter; the returned stage runs F, B, W on them."""
        with torch.no_grad():
            full = list(self.graphs.unshard(*self.shards))
        return StageExecutable(self.graphs.stage, self.split, full, self.buffers)

    def reduce_grad(self, full_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """REDUCE_GRAD: reduce-scatter full gradients into this rank's shard gradients (a collective)."""
        if len(full_grads) != len(self.shards):
            raise ValueError(f"expected {len(self.shards)} gradients (one per parameter), got {len(full_grads)}")
        with torch.no_grad():
            return list(self.graphs.reduce_grad(*full_grads))
