"""Tracing a stage's joint forward+backward into two FX graphs (AOTAutograd).

Parameters *and* buffers are lifted as graph inputs and the graphs are
functionalized ATen. Two routes: ``direct`` traces the stage module as it is;
``export`` first runs ``torch.export`` and traces the exported module (for
model code that direct tracing rejects). ``auto`` tries direct, then export.

Activation checkpointing (``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``) is honoured deliberately: AOTAutograd alone would
drop it and save the region's activations, so during capture each checkpointed
call is annotated, its forward nodes are tagged "must recompute", and the
min-cut partitioner recomputes them in the backward graph.

Recomputation chosen by octopipe, per stage (``CaptureConfig.recompute``):
``layers`` marks every non-random op inside each of the stage's layers "must
recompute" (one region per layer), so the backward keeps only each layer's
input and recomputes its internals -- full activation checkpointing, on the
graph; ``budget`` runs the min-cut partitioner under AOTAutograd's activation
memory budget (the fraction of the saved bytes it may keep). Recomputation
re-runs the same ops on the same inputs, so the gradients are bitwise those
of saving everything; random ops are never recomputed (their outputs are
saved), so the RNG is drawn as often as eager autograd draws it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import fx, nn
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.func import functional_call

from octopipe.capture.graphs import StageGraphs
from octopipe.capture.types import CaptureError

__all__ = ["RECOMPUTE_POLICIES", "CaptureConfig", "RecomputePolicy", "capture_stage", "live_nodes", "prune_dead_nodes"]

_RECOMPUTE_KEY = "octopipe_recompute_region"
_LAYER_KEY = "octopipe_layer_region"
#: region ids of octopipe's layer regions start here, clear of the checkpoint regions' ids
_LAYER_REGION_BASE = 1 << 20

#: ``none``: save what the backward reads; ``layers``: recompute each layer's internals; ``budget``: min-cut
#: under ``activation_budget``
RecomputePolicy = Literal["none", "layers", "budget"]
RECOMPUTE_POLICIES: tuple[RecomputePolicy, ...] = ("none", "layers", "budget")
_RANDOM_OPS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "randperm", "exponential")


@dataclass(kw_only=True, frozen=True)
class CaptureConfig:
    """How to capture a stage.

    ``partitioner``: ``default`` saves what the backward needs (like eager
    autograd); ``min_cut`` recomputes cheap ops to save memory. Stages with
    checkpointed regions always use ``min_cut``.
    """

    route: Literal["auto", "direct", "export"] = "auto"
    partitioner: Literal["default", "min_cut"] = "default"
    #: what the backward recomputes instead of saving (module docstring); ``layers`` needs a stage from
    #: ``split_model`` or ``split_graph`` (it knows its layers)
    recompute: RecomputePolicy = "none"
    #: for ``budget``: the fraction of the saved activation bytes the partitioner may keep, in [0, 1]
    activation_budget: float = 1.0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {self.recompute!r}")
        if not 0.0 <= self.activation_budget <= 1.0:
            raise ValueError(
                f"activation_budget is a fraction of the saved bytes in [0, 1], got {self.activation_budget}"
            )
        if self.recompute != "budget" and self.activation_budget != 1.0:
            raise ValueError("activation_budget applies only with recompute='budget'")

    @property
    def recompute_label(self) -> str:
        """``none``, ``layers`` or ``budget:F``: the policy as plans and profiles name it."""
        return f"budget:{self.activation_budget:g}" if self.recompute == "budget" else self.recompute


@contextlib.contextmanager
def _annotate_checkpoints(counter: Iterator[int]) -> Iterator[bool]:
    """Inside, each non-reentrant checkpointed call runs plainly under an fx annotation."""
    annotate = getattr(torch.fx.traceback, "annotate", None)
    original = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if annotate is None or original is None:  # this torch cannot mark regions: checkpointing is not honoured
        yield False
        return

    @contextlib.contextmanager
    def region(*args: Any, **kwargs: Any) -> Iterator[None]:
        with annotate({_RECOMPUTE_KEY: next(counter)}):
            yield

    def generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        with region():
            yield

    setattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", generator)  # noqa: B010
    try:
        with torch.fx.traceback.preserve_node_meta():
            yield True
    finally:
        setattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", original)  # noqa: B010


@contextlib.contextmanager
def _layer_region(layer: int) -> Iterator[None]:
    with torch.fx.traceback.annotate({_LAYER_KEY: layer}):
        yield


def _partition(partitioner: str, regions: list[int]) -> Callable[..., Any]:
    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy  # noqa: PLC0415

        tagged = set()
        layers = set()
        for node in joint.graph.nodes:
            if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
                continue
            custom = node.meta.get("custom") or {}
            region, layer = custom.get(_RECOMPUTE_KEY), custom.get(_LAYER_KEY)
            if region is not None:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = region
                tagged.add(region)
            elif layer is not None and not any(word in str(node.target) for word in _RANDOM_OPS):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = _LAYER_REGION_BASE + layer
                layers.add(layer)
        regions.extend(sorted(tagged))
        if tagged or layers or partitioner == "min_cut":
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return default_partition(joint, joint_inputs, **kwargs)

    return partition


def live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The output node and every node it depends on."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    live: set[fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


def prune_dead_nodes(gm: fx.GraphModule) -> tuple[str, ...]:
    """Remove nodes no output depends on, impure ones too; return their targets.

    AOTAutograd's default partitioner can leave a recomputed dropout in the
    backward graph whose result nothing uses. It is dead, but impure: fx's own
    dead-code elimination keeps it, and running it would draw from the RNG,
    which eager autograd never does. Removing it keeps RNG use equal to eager.
    """
    live = live_nodes(gm.graph)
    removed = []
    for node in reversed(list(gm.graph.nodes)):
        if node not in live and node.op not in ("placeholder", "output"):
            removed.append(str(node.target))
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return tuple(reversed(removed))


def _graph_inputs(stage: nn.Module) -> tuple[list[str], list[torch.Tensor], list[str], list[torch.Tensor]]:
    params = list(stage.named_parameters())
    buffers = list(stage.named_buffers())
    return [n for n, _ in params], [p for _, p in params], [n for n, _ in buffers], [b for _, b in buffers]


def _trace(
    module: nn.Module,
    param_names: list[str],
    buffer_names: list[str],
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grads_in: Sequence[bool],
    config: CaptureConfig,
) -> tuple[fx.GraphModule, fx.GraphModule, int, tuple[bool, ...]]:
    num_p, num_b = len(param_names), len(buffer_names)

    def joint(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = dict(zip(param_names, flat[:num_p], strict=True))
        state.update(zip(buffer_names, flat[num_p : num_p + num_b], strict=True))
        out = functional_call(module, state, tuple(flat[num_p + num_b :]), strict=True)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    captured: dict[str, fx.GraphModule] = {}

    def keep(name: str) -> Any:
        def compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
            captured[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    regions: list[int] = []
    budget = config.activation_budget if config.recompute == "budget" else 1.0
    partitioner = "min_cut" if config.recompute == "budget" else config.partitioner
    layer_regions = getattr(module, "layer_regions", None) if config.recompute == "layers" else None
    if config.recompute == "layers" and layer_regions is None:
        raise CaptureError(
            f"recompute='layers' needs a stage that knows its layers ({type(module).__name__} does not): "
            "split the model with split_model or split_graph, or use recompute='budget'"
        )
    with contextlib.ExitStack() as scope:
        scope.enter_context(_annotate_checkpoints(itertools.count()))
        scope.enter_context(functorch_config.patch(activation_memory_budget=budget))
        if layer_regions is not None:
            scope.enter_context(layer_regions(_layer_region))
        compiled = aot_function(
            joint,
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=_partition(partitioner, regions),
        )
        args = [p.detach().requires_grad_(p.requires_grad) for p in params]
        args += [b.detach() for b in buffers]
        args += [x.detach().requires_grad_(g) for x, g in zip(inputs, grads_in, strict=True)]
        outs = compiled(*args)
        differentiable = [o for o in outs if o.requires_grad]
        if not differentiable:
            raise CaptureError("the stage's output does not depend on any parameter or input that needs a gradient")
        torch.autograd.backward(differentiable, [torch.ones_like(o) for o in differentiable])
    return captured["forward"], captured["backward"], len(regions), tuple(o.requires_grad for o in outs)


@contextlib.contextmanager
def _module_stack(module: nn.Module) -> Iterator[list[str]]:
    """Record which module is running, so a failure can name it."""
    stack: list[str] = []
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            stack.append(name)

        return hook

    def leave(*_: Any) -> None:  # a forward hook must return None, or it replaces the output
        if stack:
            stack.pop()

    for name, sub in module.named_modules():
        if name:
            handles.append(sub.register_forward_pre_hook(enter(name)))
            handles.append(sub.register_forward_hook(leave))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


_HINTS = (
    (
        ("grouped_mm", "Expected inputs of BF16"),
        "torch._grouped_mm (MoE experts) cannot be traced in this dtype on this device; for a HuggingFace MoE "
        "model build the config with experts_implementation='batched_mm'",
    ),
    (
        ("_local_scalar_dense", "data-dependent", "item()"),
        "the code reads tensor values into Python (.item(), "
        "data-dependent branches or masks); make it depend on shapes only, or let route='auto' export it first",
    ),
    (
        ("inplace", "in-place", "mutat"),
        "a layer mutates a tensor in place that autograd or functionalization cannot track; write it out of place",
    ),
    (("backward", "requires_grad"), "the stage's output must be differentiable with respect to its parameters"),
)


def _explain(stage_index: int, error: BaseException, module: str | None) -> str:
    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    hint = next((h for keys, h in _HINTS if any(k in str(error) for k in keys)), "see the error above")
    where = f" in module {module!r}" if module else ""
    return f"cannot capture stage {stage_index}{where}: {text}. What to change: {hint}"


def capture_stage(
    stage: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    config: CaptureConfig | None = None,
    stage_index: int = 0,
) -> StageGraphs:
    """Trace ``stage``'s joint forward+backward for inputs shaped like ``example_inputs``.

    A floating-point first input gets an input gradient (every stage but the
    first); integer inputs (token ids) and the target do not.
    """
    config = config or CaptureConfig()
    if config.route not in ("auto", "direct", "export"):
        raise ValueError(f"route must be 'auto', 'direct' or 'export', got {config.route!r}")
    if config.partitioner not in ("default", "min_cut"):
        raise ValueError(f"partitioner must be 'default' or 'min_cut', got {config.partitioner!r}")
    inputs = list(example_inputs)
    grads_in = [i == 0 and x.is_floating_point() for i, x in enumerate(inputs)]
    marked: tuple[bool, ...] | None = getattr(stage, "input_requires_grad", None)
    if marked is not None:  # a graph stage knows which boundary tensors carry gradients
        if len(marked) != len(inputs):
            raise ValueError(f"stage {stage_index} takes {len(marked)} inputs, got {len(inputs)} example inputs")
        grads_in = list(marked)
    param_names, params, buffer_names, buffers = _graph_inputs(stage)
    routes = ["direct", "export"] if config.route == "auto" else [config.route]
    failures: list[str] = []
    for route in routes:
        module = stage
        with _module_stack(stage) as running:
            try:
                if route == "export":
                    module = torch.export.export(stage, tuple(inputs), strict=False).module()
                fw, bw, regions, out_grads = _trace(
                    module, param_names, buffer_names, params, buffers, inputs, grads_in, config
                )
            except CaptureError:
                raise
            except Exception as exc:
                failures.append(f"[{route}] " + _explain(stage_index, exc, running[-1] if running else None))
                continue
        pruned = prune_dead_nodes(bw)
        placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
        num_tangents = sum(out_grads)
        num_saved = len(placeholders) - num_tangents
        fw_out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
        leading = len(fw_out) - len(out_grads) - num_saved
        if leading != 0:
            raise CaptureError(
                f"stage {stage_index} mutates {leading} buffer(s) in place (e.g. running statistics); "
                "octopipe stages must not mutate buffers: compute such state out of place"
            )
        return StageGraphs(
            forward=fw,
            backward=bw,
            param_names=tuple(param_names),
            buffer_names=tuple(buffer_names),
            num_inputs=len(inputs),
            num_outputs=len(out_grads),
            num_saved=num_saved,
            input_requires_grad=tuple(grads_in),
            route=route,
            recompute_regions=regions,
            pruned_nodes=pruned,
            output_requires_grad=out_grads,
        )
    raise CaptureError("\n".join(failures))
