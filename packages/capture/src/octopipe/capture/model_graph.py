"""Capture a model's whole training forward as written: inputs and labels to the loss, one graph.

``trace_model`` records the user's own call, ``model(**inputs)`` returning
the loss (or an output with ``.loss``, as HuggingFace models return), once on
real tensors (``make_fx``, pre-dispatch ATen, parameters and buffers as graph
inputs), so everything the model's ``forward`` computes -- embedding and logit
multipliers, masks, rotary embeddings, auxiliary losses, the loss itself -- is
in the graph, and every branch is the one its eager run takes. (``torch.export``
would take other branches: transformers keeps, when exporting, a causal mask its
eager run skips, which changes the attention kernel and the gradients' last
bits.) A branch on a value that depends on the inputs or parameters is refused.
Each node keeps the module-call stack it ran under; ``split_graph`` cuts the
graph at layer boundaries with it.

The layers (the units a partition lists) come from, in order: ``layers=``;
the model's ``pipeline_layers()``; otherwise they are discovered: the blocks of
the model's largest ``nn.ModuleList`` (``model.layers``, ``transformer.h``) and
every other module with parameters beside it or beside one of its ancestors
(embeddings, final norm, ``lm_head``), ordered by their first use in the graph.
Modules without parameters (rotary embeddings, dropout) are glue: the code
between layers lands in the stage that runs it, in program order.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from octopipe.capture.types import CaptureError

__all__ = ["ModelGraph", "discover_layers", "trace_model"]

_ROOT = "user"  # the attribute under which the traced wrapper holds the user's model
_PREFIX = _ROOT + "."


@dataclass(frozen=True, eq=False)
class ModelGraph:
    """A model's whole training forward as one exported FX graph, and its layer order.

    ``graph``'s placeholders are, in order, one per entry of ``placeholders``:
    ``("param" | "buffer" | "input", name)`` with the model's own names (a
    tied parameter once, under its first name), and it returns the loss.
    """

    model: nn.Module
    graph: fx.GraphModule
    placeholders: tuple[tuple[str, str], ...]
    input_names: tuple[str, ...]
    #: inputs only the loss reads (labels); the runtime hands them to the last stage
    target_names: tuple[str, ...]
    layers: tuple[str, ...]
    #: node name -> the layer whose module call it ran in (absent: glue code between layers)
    node_layer: Mapping[str, str]
    example_inputs: Mapping[str, torch.Tensor]
    seconds: float

    def eager_loss(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's own eager loss for ``inputs`` (the user's call, not the graph)."""
        return _loss_of(self.model(**inputs))


class _Call(nn.Module):
    """``model(**inputs)`` as the user calls it, with parameters and buffers as arguments; returns the loss."""

    def __init__(
        self, model: nn.Module, extra: Mapping[str, object], state_names: Sequence[str], input_names: Sequence[str]
    ) -> None:
        super().__init__()
        setattr(self, _ROOT, model)
        self._extra = dict(extra)
        self._state_names = tuple(state_names)
        self._input_names = tuple(input_names)

    def forward(self, state: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
        values = dict(zip(self._state_names, state, strict=True))
        kwargs = dict(zip(self._input_names, inputs, strict=True))
        out = functional_call(getattr(self, _ROOT), values, (), {**kwargs, **self._extra})
        return _loss_of(out)


def _loss_of(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"the model returned {type(out).__name__} without a loss: call it with the labels it needs "
        "(e.g. labels=...), or give octopipe a model whose forward returns the training loss"
    )


def _stack_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else ""
        if isinstance(path, str) and path.startswith(_PREFIX):
            paths.append(path[len(_PREFIX) :])
    return paths


def discover_layers(model: nn.Module, graph: fx.GraphModule, placeholders: Sequence[tuple[str, str]]) -> list[str]:
    """The model's layers in first-use order (see the module docstring)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    candidates: list[str] = []
    if lists:
        path, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
        candidates += [f"{path}.{i}" for i in range(len(blocks))]
        parts = path.split(".")
        for depth in range(len(parts)):
            ancestor = ".".join(parts[:depth])
            inside = ".".join(parts[: depth + 1])
            parent = model.get_submodule(ancestor)
            for child, sub in parent.named_children():
                full = f"{ancestor}.{child}" if ancestor else child
                if full != inside and any(True for _ in sub.parameters()):
                    candidates.append(full)
    else:
        candidates = [name for name, sub in model.named_children() if any(True for _ in sub.parameters())]
    # ordered by their first module call; a module never called whose parameters are used, by that use
    first_call: dict[str, int] = {}
    first_use: dict[str, int] = {}
    names = [p for p in graph.graph.nodes if p.op == "placeholder"]
    by_placeholder = dict(zip(names, placeholders, strict=True))
    for index, node in enumerate(graph.graph.nodes):
        if node.op != "call_function":
            continue
        called = set(_stack_paths(node))
        used = {by_placeholder[a][1] for a in node.all_input_nodes if a in by_placeholder}
        for cand in candidates:
            if cand not in first_call and any(u == cand or u.startswith(cand + ".") for u in called):
                first_call[cand] = index
            if cand not in first_use and any(u.startswith(cand + ".") for u in used):
                first_use[cand] = index
    order = {c: first_call.get(c, first_use.get(c, -1)) for c in candidates}
    return sorted((c for c in candidates if order[c] >= 0), key=order.__getitem__)


def _layer_of(node: fx.Node, layers: Sequence[str]) -> str | None:
    for path in _stack_paths(node):
        for layer in layers:
            if path == layer or path.startswith(layer + "."):
                return layer
    return None


def trace_model(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    *,
    layers: Sequence[str] | None = None,
    targets: Sequence[str] | None = None,
    extra: Mapping[str, object] | None = None,
) -> ModelGraph:
    """Export ``model(**inputs, **extra)``'s loss as one graph with module-call metadata.

    ``targets`` names the inputs that only the loss reads (default: ``labels``
    when given, else the last input). ``extra`` are non-tensor keyword
    arguments of the call (default: none, the call exactly as the user makes
    it). Nothing is added on the user's behalf: ``use_cache=False``, say,
    changes what a transformers model computes (GPT2's eager attention then
    multiplies non-contiguous keys, and its gradients differ in the last bits
    from the user's ``model(input_ids=..., labels=...)``).
    """
    if not inputs:
        raise ValueError("give the model's inputs by name, e.g. inputs={'input_ids': ids, 'labels': ids}")
    names = tuple(inputs)
    if targets is None:
        targets = ("labels",) if "labels" in inputs else (names[-1],)
    unknown = [t for t in targets if t not in inputs]
    if unknown:
        raise ValueError(f"targets {unknown} are not among the inputs {list(names)}: name the label inputs")
    params = list(model.named_parameters())  # a tied parameter once, under its first name
    buffers = list(model.named_buffers())
    call = _Call(model, extra or {}, [n for n, _ in params + buffers], names)
    state = [p.detach().requires_grad_(p.requires_grad) for _, p in params] + [b for _, b in buffers]
    # distinct tensors per input: one tensor passed twice (input_ids as labels) would become one graph input
    values = [inputs[n].clone() for n in names]
    start = time.perf_counter()
    graph = _record(call, state, values)
    seconds = time.perf_counter() - start
    placeholders = [("param", n) for n, _ in params] + [("buffer", n) for n, _ in buffers]
    placeholders += [("input", n) for n in names]
    _check_value_reads(graph, placeholders)
    layer_names = list(layers) if layers is not None else _hinted_layers(model)
    if layer_names is None:
        layer_names = discover_layers(model, graph, placeholders)
    known = dict(model.named_modules())
    missing = [n for n in layer_names if n not in known or n == ""]
    if missing:
        raise ValueError(
            f"layers {missing} are not modules of {type(model).__name__}; known names include {sorted(known)[1:9]}"
        )
    if len(set(layer_names)) != len(layer_names):
        raise ValueError(f"layer names repeat: {layer_names}")
    node_layer = {}
    for node in graph.graph.nodes:
        if node.op == "call_function":
            layer = _layer_of(node, layer_names)
            if layer is not None:
                node_layer[node.name] = layer
    return ModelGraph(
        model=model,
        graph=graph,
        placeholders=tuple(placeholders),
        input_names=names,
        target_names=tuple(targets),
        layers=tuple(layer_names),
        node_layer=node_layer,
        example_inputs=dict(inputs),
        seconds=seconds,
    )


def _hinted_layers(model: nn.Module) -> list[str] | None:
    hint: Callable[[], Sequence[str]] | None = getattr(model, "pipeline_layers", None)
    return list(hint()) if callable(hint) else None


def _record(call: _Call, state: list[torch.Tensor], values: list[torch.Tensor]) -> fx.GraphModule:
    """Run the call once on real tensors, recording every ATen op with the module call it ran in.

    Real tensors, so the model takes the branches its eager run takes (a mask it
    skips in eager is skipped here too); ``_check_value_reads`` then refuses any
    branch that read a value depending on the inputs or parameters.
    """
    options: dict[str, Any] = {"tracing_mode": "real", "pre_dispatch": True, "record_module_stack": True}
    if "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters:
        options["_error_on_data_dependent_ops"] = False  # recorded, then checked by _check_value_reads

    def run(state: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        return call(state, values)

    run._orig_mod = call  # type: ignore[attr-defined]  # make_fx names module calls relative to this module
    with _quiet(), torch.fx.traceback.preserve_node_meta():
        try:
            graph = make_fx(run, **options)(state, values)
        except Exception as exc:
            raise CaptureError(_explain(exc)) from None
    return graph


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers warns about training-time settings on every call; capture runs it once more, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


#: ops that read tensor values into Python or whose output shape depends on them
_VALUE_READS = ("aten.item", "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose")


def _reads_values(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if str(node.target).startswith(_VALUE_READS):
        return True
    tags = getattr(node.target, "tags", ())
    if str(node.target).startswith(("aten.index.", "aten.index_put")):  # shape depends on data only for masks
        indices = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else ()
        dtypes = [getattr(i.meta.get("val"), "dtype", None) for i in indices if isinstance(i, fx.Node)]
        return any(d in (torch.bool, torch.uint8) for d in dtypes)
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def _check_value_reads(graph: fx.GraphModule, placeholders: Sequence[tuple[str, str]]) -> None:
    """Refuse reads of values that depend on inputs or parameters; drop reads of shape-only values.

    A branch on a shape-only value (positions from ``arange``) is the same for
    every input of these shapes: its recorded outcome holds. A branch on data
    would hold only for the example batch, so it is refused, naming the module.
    """
    data: set[fx.Node] = set()
    nodes = list(graph.graph.nodes)
    kinds = dict(zip([n for n in nodes if n.op == "placeholder"], placeholders, strict=True))
    for node in nodes:
        if node.op == "placeholder":
            if kinds[node][0] in ("param", "input"):
                data.add(node)
        elif any(a in data for a in node.all_input_nodes):
            data.add(node)
    for node in nodes:
        if _reads_values(node) and node in data:
            paths = _stack_paths(node)
            where = f" in module {paths[-1]!r}" if paths else ""
            raise CaptureError(
                f"cannot capture the model's forward{where}: {node.target} reads tensor values that depend on the "
                "inputs or parameters (.item(), nonzero, a data-dependent loop or mask), so its recorded outcome "
                "would hold only for this batch. What to change: make the code depend on shapes only -- e.g. MoE "
                "experts written as a loop over the experts that received tokens: build the HuggingFace config with "
                "experts_implementation='batched_mm' (or 'grouped_mm') where the family offers it"
            )
    for node in reversed(nodes):
        if _reads_values(node) and not node.users:
            graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()
    graph.recompile()


_HINTS = (
    (
        ("_local_scalar_dense", "data-dependent", "item", "nonzero"),
        "the model reads tensor values into Python (.item(), nonzero, data-dependent loops or masks); "
        "make it depend on shapes only",
    ),
)


def _explain(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    hint = next((h for keys, h in _HINTS if any(k in text for k in keys)), "see the error above")
    return f"cannot capture the model's forward: {type(error).__name__}: {first}. What to change: {hint}"
