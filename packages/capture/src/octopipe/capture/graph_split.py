"""Cut a captured whole-model graph into pipeline stages at layer boundaries.

Every node runs in exactly one stage: a node inside a layer's module call in
that layer's stage, glue code between layers in the stage that runs it in
program order (so code after the last layer -- the loss, auxiliary losses --
is in the last stage). A value one stage makes and a later stage reads
crosses every boundary in between as a stage output/input; values that depend
only on buffers and shapes (rotary tables, causal masks) are recomputed by the
stages that read them instead (the same ops, so the same numbers). Stage 0
takes the model's inputs except the targets; the last stage takes the values
crossing into it, then the targets, and returns the loss.

A parameter that several stages use (tied input/output embeddings) is held by
each of them under the name that stage uses; ``tied_parameters`` lists them.
Their gradients must be summed across those stages before the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from octopipe.capture.model_graph import ModelGraph
from octopipe.capture.stage import StageModule
from octopipe.capture.types import CaptureError

__all__ = ["GraphStage", "TiedParameter", "split_graph", "tied_parameters"]

#: node meta key: the index (in its stage) of the layer whose module call the node ran in
LAYER_META = "octopipe_layer_index"
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "randperm", "exponential")


@dataclass(frozen=True)
class TiedParameter:
    """One parameter used by several stages; ``uses`` are (stage index, the name that stage holds it under)."""

    name: str
    uses: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.uses)


class _Container(nn.Module):
    """Holds parameters and buffers under their original dotted names."""


class GraphStage(StageModule):
    """One stage of a whole-model graph: ``forward(*inputs)`` returns its boundary outputs (or the loss)."""

    graph: fx.GraphModule

    def __init__(
        self,
        graph: fx.GraphModule,
        *,
        stage_index: int,
        num_stages: int,
        layer_names: Sequence[str],
        params: Sequence[tuple[str, nn.Parameter]],
        buffers: Sequence[tuple[str, torch.Tensor]],
        input_names: Sequence[str],
        output_names: Sequence[str],
        num_targets: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        if not layer_names:
            raise ValueError(f"stage {stage_index} has no layers: give every stage at least one layer")
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_names = tuple(layer_names)
        self._loss = None
        self._runs = ()
        object.__setattr__(self, "graph", graph)  # not a submodule: it holds no state
        self.param_order = tuple(name for name, _ in params)
        self.buffer_order = tuple(name for name, _ in buffers)
        #: boundary inputs (the model's inputs on stage 0), then, on the last stage, the ``num_targets`` targets
        self.input_names = tuple(input_names)
        self.num_targets = num_targets
        self.output_names = tuple(output_names)
        self.input_requires_grad: tuple[bool, ...] = tuple(False for _ in input_names)
        self.output_requires_grad: tuple[bool, ...] = tuple(True for _ in output_names)
        self._region: Callable[[int], contextlib.AbstractContextManager[None]] | None = None
        for name, param in params:
            self._container(name).register_parameter(name.rsplit(".", 1)[-1], param)
        for name, buffer in buffers:
            self._container(name).register_buffer(name.rsplit(".", 1)[-1], buffer)

    @property
    def boundary_names(self) -> tuple[str, ...]:
        """The inputs that come from the previous stage (the model's non-target inputs on stage 0)."""
        return self.input_names[: len(self.input_names) - self.num_targets]

    def _lookup(self, name: str) -> torch.Tensor:
        path, _, leaf = name.rpartition(".")
        value = getattr(self.get_submodule(path), leaf)
        assert isinstance(value, torch.Tensor), name
        return value

    def _container(self, name: str) -> nn.Module:
        parent: nn.Module = self
        for part in name.split(".")[:-1]:
            child = parent._modules.get(part)
            if child is None:
                child = _Container()
                parent.add_module(part, child)
            parent = child
        return parent

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # type: ignore[override]
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"stage {self.stage_index} takes {len(self.input_names)} inputs {list(self.input_names)}, "
                f"got {len(inputs)}"
            )
        # plain attribute lookups: under functional_call (capture) the parameters are plain tensors
        state = [self._lookup(n) for n in (*self.param_order, *self.buffer_order)]
        if self._region is None:
            outputs = tuple(self.graph(*state, *inputs))
        else:
            outputs = tuple(_RegionInterpreter(self.graph, self._region).run(*state, *inputs))
        return outputs[0] if len(outputs) == 1 else outputs


class _RegionInterpreter(fx.Interpreter):
    """Runs a stage graph node by node, each layer's ops inside that layer's region.

    The region is entered around the op itself, inside the interpreter's own node context (which replaces
    the tracing metadata with the node's), so the ops it records carry the region's annotation."""

    def __init__(
        self, module: fx.GraphModule, region: Callable[[int], contextlib.AbstractContextManager[None]]
    ) -> None:
        super().__init__(module)
        self._layer_region = region
        self._layer: int | None = None

    def run_node(self, n: fx.Node) -> Any:
        self._layer = n.meta.get(LAYER_META)
        return super().run_node(n)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self._layer is None:
            return super().call_function(target, args, kwargs)
        with self._layer_region(self._layer):
            return super().call_function(target, args, kwargs)


def _is_random(node: fx.Node) -> bool:
    return any(word in str(node.target) for word in _RANDOM)


def _check_partition(order: Sequence[str], partition: Sequence[Sequence[str]]) -> None:
    flat = [name for stage in partition for name in stage]
    if flat == list(order):
        return
    unknown = sorted(set(flat) - set(order))
    missing = [n for n in order if n not in flat]
    detail = (
        f"unknown layers {unknown}" if unknown else f"missing layers {missing}" if missing else "layers out of order"
    )
    raise ValueError(f"the partition must list every layer once, in model order ({order[0]} ... {order[-1]}): {detail}")


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    returns: Sequence[Any] = getattr(schema, "returns", ())
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def split_graph(graph: ModelGraph, partition: Sequence[Sequence[str]], *, allow_tied: bool = False) -> list[GraphStage]:
    """Cut ``graph`` into ``len(partition)`` stages; ``partition[s]`` lists stage s's layers in order.

    ``allow_tied``: a parameter used by several stages (tied embeddings) is
    refused unless the caller sums its gradients across those stages (see
    ``tied_parameters``); a runtime that does not would train the copies apart.
    """
    if any(not names for names in partition):
        empty = next(s for s, names in enumerate(partition) if not names)
        raise ValueError(f"stage {empty} has no layers: give every stage at least one layer")
    _check_partition(graph.layers, partition)
    last = len(partition) - 1
    stage_of_layer = {name: s for s, names in enumerate(partition) for name in names}
    nodes = list(graph.graph.graph.nodes)
    kinds = dict(zip([n for n in nodes if n.op == "placeholder"], graph.placeholders, strict=True))
    stage_of: dict[fx.Node, int] = {}
    free: set[fx.Node] = set()  # depends only on buffers, constants and shapes: recomputed where read
    current, current_layer = 0, graph.layers[0]
    for node in nodes:
        if node.op == "placeholder":
            if kinds[node][0] == "buffer":
                free.add(node)
            continue
        if node.op == "output":
            continue
        layer = graph.node_layer.get(node.name)
        if layer is not None:
            if stage_of_layer[layer] < current:
                raise CaptureError(
                    f"layer {layer!r} (stage {stage_of_layer[layer]}) runs after layer {current_layer!r} "
                    f"(stage {current}): list layers in the order the model's forward calls them"
                )
            current, current_layer = stage_of_layer[layer], layer
        stage_of[node] = current
        if node.op == "get_attr" or (not _is_random(node) and all(a in free for a in node.all_input_nodes)):
            free.add(node)
    output = nodes[-1]
    (loss,) = output.args[0]

    def producer(value: fx.Node) -> int:  # the model's inputs enter at stage 0
        return stage_of.get(value, 0)

    reads: list[set[fx.Node]] = [set() for _ in partition]  # values each stage reads from earlier stages
    copies: list[set[fx.Node]] = [set() for _ in partition]  # free nodes each stage recomputes
    leaves: list[set[fx.Node]] = [set() for _ in partition]  # parameter and buffer placeholders each stage uses

    def recompute(stage: int, value: fx.Node) -> None:
        stack = [value]
        while stack:
            node = stack.pop()
            if node.op == "placeholder":
                leaves[stage].add(node)
            elif node not in copies[stage]:
                copies[stage].add(node)
                stack.extend(node.all_input_nodes)

    for node, stage in stage_of.items():
        for value in node.all_input_nodes:
            kind, name = kinds.get(value, ("node", ""))
            if kind in ("param", "buffer"):
                leaves[stage].add(value)
            elif kind == "input" and name in graph.target_names:
                if stage != last:
                    raise CaptureError(
                        f"input {name!r} is read by stage {stage} (layer code or glue before the last stage), "
                        "but targets reach only the last stage: drop it from targets="
                    )
            elif producer(value) < stage or (kind == "input" and stage > 0):
                if value in free:
                    recompute(stage, value)
                else:
                    reads[stage].add(value)
    order = {node: i for i, node in enumerate(nodes)}
    first_inputs = [n for n in nodes if kinds.get(n, ("", ""))[0] == "input" and kinds[n][1] not in graph.target_names]
    targets = sorted(
        (n for n in nodes if kinds.get(n, ("", ""))[0] == "input" and kinds[n][1] in graph.target_names),
        key=lambda n: graph.target_names.index(kinds[n][1]),
    )
    crossing = [
        sorted({v for t in range(s, len(partition)) for v in reads[t] if producer(v) < s}, key=order.__getitem__)
        for s in range(len(partition))
    ]
    model_params = dict(graph.model.named_parameters(remove_duplicate=False))
    model_buffers = dict(graph.model.named_buffers(remove_duplicate=False))
    stages = []
    for s, layer_names in enumerate(partition):
        inputs = first_inputs if s == 0 else crossing[s]
        outputs = [loss] if s == last else crossing[s + 1]
        keep = {n for n, t in stage_of.items() if t == s} | copies[s]
        stages.append(
            _build_stage(
                graph, s, len(partition), layer_names, keep, leaves[s], kinds, inputs,
                targets if s == last else [], outputs, model_params, model_buffers,
            )
        )  # fmt: skip
    _mark_requires_grad(graph, stages)
    tied = tied_parameters(stages)
    if tied and not allow_tied:
        first = tied[0]
        raise ValueError(
            f"parameter {first.name!r} is used by stages {list(first.stages)} (tied weights): pass allow_tied=True "
            "only if the runtime sums its gradients across those stages (tied_parameters()), or keep its users "
            "in one stage"
        )
    return stages


def _build_stage(
    graph: ModelGraph,
    s: int,
    num_stages: int,
    layer_names: Sequence[str],
    keep: set[fx.Node],
    leaves: set[fx.Node],
    kinds: Mapping[fx.Node, tuple[str, str]],
    inputs: Sequence[fx.Node],
    targets: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    model_params: Mapping[str, nn.Parameter],
    model_buffers: Mapping[str, torch.Tensor],
) -> GraphStage:
    source = graph.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    params: list[tuple[str, nn.Parameter]] = []
    by_identity: dict[int, fx.Node] = {}
    buffers: list[tuple[str, torch.Tensor]] = []
    ordered = [n for n in source.graph.nodes if n in leaves]
    for node in ordered:  # parameters first (one placeholder per tensor), then buffers
        kind, name = kinds[node]
        if kind == "param":
            param = model_params[name]
            if id(param) in by_identity:  # the same tensor under a second name: one input, gradients summed
                env[node] = by_identity[id(param)]
                continue
            env[node] = by_identity[id(param)] = new.placeholder(name.replace(".", "_"))
            params.append((name, param))
    for node in ordered:
        kind, name = kinds[node]
        if kind == "buffer":
            buffers.append((name, model_buffers[name]))
        else:
            continue
        env[node] = new.placeholder(name.replace(".", "_"))
    for node in [*inputs, *targets]:
        env[node] = new.placeholder(node.name)
        env[node].meta = dict(node.meta)
    layer_index = {name: i for i, name in enumerate(layer_names)}
    for node in source.graph.nodes:
        if node in keep and node not in env:
            env[node] = new.node_copy(node, lambda n: env[n])
            env[node].meta[LAYER_META] = layer_index.get(graph.node_layer.get(node.name, ""))
    results = []
    for node in outputs:
        value = env[node]
        if value.op == "placeholder" or _is_view(value):  # a fresh tensor: no output aliases an input or another output
            value = new.call_function(torch.ops.aten.clone.default, (value,))
        results.append(value)
    new.output(tuple(results))
    new.eliminate_dead_code()
    module = fx.GraphModule(source, new)
    names = [*(kinds[n][1] if n in kinds else n.name for n in inputs), *(kinds[n][1] for n in targets)]
    return GraphStage(
        module,
        stage_index=s,
        num_stages=num_stages,
        layer_names=layer_names,
        params=params,
        buffers=buffers,
        input_names=names,
        output_names=["loss"] if s == num_stages - 1 else [kinds[n][1] if n in kinds else n.name for n in outputs],
        num_targets=len(targets),
    )


def _mark_requires_grad(graph: ModelGraph, stages: Sequence[GraphStage]) -> None:
    """Run the stages once on the example inputs: which boundary tensors carry gradients."""
    example = graph.example_inputs
    values = [example[n] for n in stages[0].boundary_names]
    with torch.random.fork_rng(devices=[]):
        for stage in stages:
            if stage.is_last:
                values = values + [example[n] for n in graph.target_names]
            stage.input_requires_grad = tuple(v.requires_grad for v in values)
            values = [v.detach().requires_grad_(v.requires_grad) for v in values]
            out = stage(*values)
            outputs = [out] if isinstance(out, torch.Tensor) else list(out)
            stage.output_requires_grad = tuple(o.requires_grad for o in outputs)
            values = outputs


def tied_parameters(stages: Sequence[nn.Module]) -> list[TiedParameter]:
    """Parameters held by more than one stage, with the name each stage uses (model order)."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            uses.setdefault(id(param), []).append((index, name))
    return [TiedParameter(name=u[0][1], uses=tuple(u)) for u in uses.values() if len({s for s, _ in u}) > 1]
