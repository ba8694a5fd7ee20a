"""Tensor parallelism for the zoo's layers: Megatron-LM's column- then row-parallel split, in place.

:func:`tensor_parallel` slices every tensor-parallel layer of a module (a
pipeline stage, a whole model) over a process group of ``W`` ranks; rank
``r`` keeps its slice of each weight under the weight's own name (see
:class:`octopipe.transform.TPSpec`) and the layer calls
``octopipe.transform``'s differentiable functional collectives at its edges:

- :class:`Attention`: ``wqkv`` column-parallel in 3 blocks (rank r holds heads
  r*H/W .. of q, of k and of v), ``wo`` row-parallel; heads per rank H / W.
- :class:`SwiGLU`: ``w1`` and ``w3`` column-, ``w2`` row-parallel;
  :class:`SquaredReluMLP`: ``up`` column-, ``down`` row-parallel.
- :class:`Mamba` (per-channel and per-head forms): ``in_proj`` column-parallel
  in 2 blocks (u and z), the depthwise ``conv``, ``dt_proj``, ``a_log`` and ``d``
  split by channel (or head), ``x_proj`` row-parallel with an all-reduce both
  ways (its output, dt / B / C, is used by every rank on its own channels only),
  ``out_proj`` row-parallel.
- :class:`MoE`: every expert's hidden units (``w1``/``w3`` column-, ``w2``
  row-parallel); the router stays whole. The collectives wrap the experts only
  (the dispatch buffer in, the expert outputs out): routing is replicated, so
  its gradient is too.

Layer inputs pass through ``copy_to_tp`` (identity; their gradient is
all-reduced) and outputs through ``reduce_from_tp`` (all-reduced; identity
backward). Everything else (embedding, norms, head and loss) is replicated:
every rank computes the same activations and the same gradients for them.
Per layer this is one all-reduce of a ``[batch, seq, hidden]`` activation in
the forward and one in the backward, for the mixer and for the MLP each.
Dropout is refused (the ranks' random streams would have to agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from octopipe.capture import StageModule
from octopipe.examples.models import Attention, Block, DecoderLM, Head, Mamba, MoE, SquaredReluMLP, SwiGLU
from octopipe.execute.runtime.models import build_model
from octopipe.execute.runtime.pretrained import params_on_meta
from octopipe.ir import PlanError, check_mesh_model, mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.transform.tensor_parallel import (
    TPSpec,
    all_reduce_tp,
    copy_to_tp,
    gather_sequence,
    reduce_from_tp,
    scatter_sequence,
    slice_parameter,
)

__all__ = [
    "loss_parallel",
    "split_problem",
    "split_stage",
    "tensor_parallel",
    "tensor_parallel_facts",
    "vocab_parallel_cross_entropy",
]

_functional = torch.ops._c10d_functional

M = TypeVar("M", bound=nn.Module)


def _edges(module: nn.Module, group: dist.ProcessGroup, sequence: bool) -> None:
    """The layer's entry and exit collectives: f and g, or (sequence parallel) all-gather and reduce-scatter
    of the sequence (dim 1 of ``[batch, seq, hidden]``)."""
    name, world = str(group.group_name), dist.get_world_size(group)

    def enter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = gather_sequence(args[0], 1, name, world) if sequence else copy_to_tp(args[0], name)
        return (x, *args[1:])

    def leave(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return scatter_sequence(out, 1, name, world) if sequence else reduce_from_tp(out, name)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _split(
    module: nn.Module, prefix: str, group: dist.ProcessGroup, layout: dict[str, tuple[int, int]]
) -> dict[str, TPSpec]:
    specs = {}
    for path, (dim, blocks) in layout.items():
        owner_path, _, name = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        specs[f"{prefix}{path}"] = slice_parameter(owner, name, dim=dim, blocks=blocks, group=group)
    return specs


def _attention(
    module: Attention, prefix: str, group: dist.ProcessGroup, world: int, sequence: bool
) -> dict[str, TPSpec]:
    if module.heads % world:
        raise ValueError(f"{prefix or 'attention'}: tp={world} does not divide its {module.heads} heads")
    specs = _split(module, prefix, group, {"wqkv.weight": (0, 3), "wo.weight": (1, 1)})
    module.heads //= world
    _edges(module, group, sequence)
    return specs


def _mamba(module: Mamba, prefix: str, group: dist.ProcessGroup, world: int, sequence: bool) -> dict[str, TPSpec]:
    channels = module.heads if module.heads is not None else module.inner
    if channels % world:
        raise ValueError(f"{prefix or 'mamba'}: tp={world} does not divide its {channels} heads (channels)")
    layout = {
        "in_proj.weight": (0, 2),
        "conv.weight": (0, 1),
        "x_proj.weight": (1, 1),
        "dt_proj.weight": (0, 1),
        "a_log": (0, 1),
        "d": (0, 1),
        "out_proj.weight": (1, 1),
    }
    for optional in ("conv.bias", "dt_proj.bias"):
        owner, _, name = optional.partition(".")
        if getattr(module.get_submodule(owner), name) is not None:
            layout[optional] = (0, 1)
    specs = _split(module, prefix, group, layout)
    module.inner //= world
    if module.heads is not None:
        module.heads //= world
    module.conv.groups = module.conv.in_channels = module.conv.out_channels = module.inner
    name = str(group.group_name)
    module.x_proj.register_forward_hook(lambda _m, _a, out: all_reduce_tp(out, name))
    _edges(module, group, sequence)
    return specs


def _moe(module: MoE, prefix: str, group: dist.ProcessGroup, world: int) -> dict[str, TPSpec]:
    if type(module) is not MoE:
        raise ValueError(f"{prefix or 'moe'}: tensor parallelism with expert parallelism is not supported: use ep=1")
    specs = _split(module, prefix, group, {"w1": (2, 1), "w3": (2, 1), "w2": (1, 1)})
    name = str(group.group_name)
    experts: Callable[[torch.Tensor], torch.Tensor] = module.expert_forward

    def expert_forward(buffer: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(experts(copy_to_tp(buffer, name)), name)

    module.expert_forward = expert_forward  # type: ignore[method-assign]
    return specs


def _vocab_embedding(embed: nn.Embedding, prefix: str, group: dist.ProcessGroup) -> dict[str, TPSpec]:
    """Rows of the embedding by vocabulary: each rank looks up the tokens of its rows (zeros for the others) and
    the ranks' lookups are summed (an all-reduce of exact zeros and one value: the whole lookup, bitwise)."""
    if embed.padding_idx is not None or embed.max_norm is not None or embed.sparse:
        raise ValueError(f"{prefix}: a vocabulary-parallel embedding needs no padding_idx, max_norm or sparse")
    world, rank, name = dist.get_world_size(group), dist.get_rank(group), str(group.group_name)
    if embed.num_embeddings % world:
        raise ValueError(f"{prefix}: tp={world} does not divide its vocabulary of {embed.num_embeddings}")
    spec = slice_parameter(embed, "weight", dim=0, blocks=1, group=group)
    rows = embed.num_embeddings // world
    start = rank * rows

    def lookup(tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - start
        inside = (local >= 0) & (local < rows)
        picked = F.embedding(local.clamp(0, rows - 1), embed.weight) * inside.unsqueeze(-1).to(embed.weight.dtype)
        return reduce_from_tp(picked, name)

    embed.forward = lookup  # type: ignore[method-assign,assignment]
    return {f"{prefix}weight": spec}


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group_name: str, world: int, rank: int, ignore_index: int = -100
) -> torch.Tensor:
    """``F.cross_entropy(logits.flatten(0, 1), target.flatten())`` (mean over the targets that are not
    ``ignore_index``) from this rank's slice ``logits`` [..., V / world] of the vocabulary: the max, the sum of
    exponentials and the target's logit are combined over the group; every rank gets the whole loss."""
    flat, targets = logits.flatten(0, -2), target.flatten()
    rows = flat.shape[-1]
    peak = _functional.wait_tensor(_functional.all_reduce(flat.detach().amax(-1).contiguous(), "max", group_name))
    shifted = flat - peak.unsqueeze(-1)  # the log-sum-exp does not depend on the shift: no gradient through it
    total = reduce_from_tp(shifted.exp().sum(-1), group_name)
    local = targets - rank * rows
    inside = (local >= 0) & (local < rows)
    picked = shifted.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) * inside.to(shifted.dtype)
    chosen = reduce_from_tp(picked, group_name)
    kept = (targets != ignore_index).to(shifted.dtype)
    return ((total.log() - chosen) * kept).sum() / kept.sum()


def loss_parallel(stage: StageModule, group: dist.ProcessGroup) -> dict[str, TPSpec]:
    """The zoo's head split by vocabulary (its projection column-parallel) and the stage's loss computed by
    :func:`vocab_parallel_cross_entropy` from the split logits: the zoo's loss, ``DecoderLM.pipeline_loss``,
    is that mean cross-entropy. A stage without the head is left as it is."""
    head = stage.get_submodule("head") if hasattr(stage, "head") else None
    if not isinstance(head, Head):
        return {}
    world, rank, name = dist.get_world_size(group), dist.get_rank(group), str(group.group_name)
    if head.proj.out_features % world:
        raise ValueError(f"head: tp={world} does not divide its vocabulary of {head.proj.out_features}")
    specs = _split(head, "head.", group, {"proj.weight": (0, 1)})
    head.proj.register_forward_pre_hook(lambda _m, args: (copy_to_tp(args[0], name), *args[1:]))
    stage.replace_loss(lambda _root, out, target: vocab_parallel_cross_entropy(out, target, name, world, rank))
    return specs


def tensor_parallel(module: M, group: dist.ProcessGroup, *, sequence_parallel: bool = False) -> dict[str, TPSpec]:
    """Slice every tensor-parallel layer of ``module`` over ``group`` in place (see the module docstring).

    Every rank must hold the same whole weights first (built from the same
    seed). Returns each sliced parameter's spec by its name in ``module``.
    ``sequence_parallel``: the module runs on this rank's slice of the
    sequence between layers (the caller feeds it that slice).
    """
    world = dist.get_world_size(group)
    sequence = sequence_parallel
    specs: dict[str, TPSpec] = {}
    if world == 1:
        return specs
    for prefix, sub in list(module.named_modules()):
        dotted = f"{prefix}." if prefix else ""
        if isinstance(sub, Block) and sub.dropout:
            raise ValueError(f"{prefix}: tensor parallelism needs dropout 0 (got {sub.dropout}): build without dropout")
        if isinstance(sub, Attention):
            if sub.dropout:
                raise ValueError(f"{prefix}: tensor parallelism needs attention dropout 0 (got {sub.dropout})")
            specs.update(_attention(sub, dotted, group, world, sequence))
        elif isinstance(sub, SwiGLU):
            specs.update(_split(sub, dotted, group, {"w1.weight": (0, 1), "w3.weight": (0, 1), "w2.weight": (1, 1)}))
            _edges(sub, group, sequence)
        elif isinstance(sub, SquaredReluMLP):
            specs.update(_split(sub, dotted, group, {"up.weight": (0, 1), "down.weight": (1, 1)}))
            _edges(sub, group, sequence)
        elif isinstance(sub, Mamba):
            specs.update(_mamba(sub, dotted, group, world, sequence))
        elif isinstance(sub, MoE):
            if sequence:
                raise ValueError(f"{prefix}: sequence parallelism with MoE layers is not supported: drop it")
            specs.update(_moe(sub, dotted, group, world))
    return specs


def split_stage(
    stage: StageModule, model: nn.Module, group: dist.ProcessGroup, *, sequence_parallel: bool
) -> dict[str, TPSpec]:
    """A pipeline stage of ``model`` over a tensor-parallel group: its layers (:func:`tensor_parallel`) and,
    without sequence parallelism and for the zoo's :class:`DecoderLM` (whose loss is the mean cross-entropy),
    its embedding and head by vocabulary with the loss computed from the split logits (:func:`loss_parallel`).
    With sequence parallelism each rank holds other tokens, so the embedding and head stay whole."""
    specs = tensor_parallel(stage, group, sequence_parallel=sequence_parallel)
    if sequence_parallel or type(model) is not DecoderLM:
        return specs
    embed = stage.get_submodule("embed") if hasattr(stage, "embed") else None
    if isinstance(embed, nn.Embedding):
        specs.update(_vocab_embedding(embed, "embed.", group))
    specs.update(loss_parallel(stage, group))
    return specs


def tensor_parallel_facts(model: nn.Module) -> dict[str, int]:
    """The sizes a tp degree must divide (``octopipe.ir.check_mesh_model``'s facts), from the model's layers."""
    facts: dict[str, int] = {}
    for sub in model.modules():
        if isinstance(sub, Attention):
            facts["heads"] = sub.heads
        elif isinstance(sub, Mamba):
            facts["mamba_heads"] = sub.heads if sub.heads is not None else sub.inner
            facts["mamba_layers"] = facts.get("mamba_layers", 0) + 1
        elif isinstance(sub, SwiGLU):
            facts["ffn"] = sub.w1.out_features
        elif isinstance(sub, SquaredReluMLP):
            facts["mlp_ffn"] = sub.up.out_features
        elif isinstance(sub, MoE):
            facts["moe_layers"] = facts.get("moe_layers", 0) + 1
    if type(model) is DecoderLM:  # the embedding and head split by vocabulary (without sequence parallelism)
        facts["vocab"] = model.config.vocab
    return facts


def split_problem(plan: plan_pb2.Plan) -> str:
    """Why ``plan``'s model cannot be split over its mesh's tp and cp ranks, in one line ("" when it can).

    Builds the model with meta parameters (no memory, no weights drawn) to read its sizes, and refuses
    what the runtime would otherwise discover in every rank: tp not dividing heads or hidden units, cp
    not dividing the sequence, cp on Mamba layers, a model none of whose layers can be split."""
    spec = mesh_spec(plan)
    if spec.tp == 1 and spec.cp == 1:
        return ""
    if spec.ep > 1:
        return (
            f"expert parallelism (ep={spec.ep}) with tp or cp > 1 is not supported (the mesh is {spec.shape}): "
            "use ep=1 (tensor parallelism splits every expert's hidden units instead)"
        )
    with params_on_meta():
        built = build_model(plan.model)
    if built.input_names is not None:
        return (
            f"tensor and context parallelism ({spec.shape}) split the zoo's layers (layer-list stages); "
            "a whole-model capture runs with tp = cp = 1: drop them from the plan's mesh"
        )
    facts = tensor_parallel_facts(built.model)
    if spec.tp > 1 and not facts:
        return f"tp={spec.tp}: the model has no layer tensor parallelism can split (attention, MLP, Mamba): use tp=1"
    facts["sequence"] = int(built.batch(0)[0].shape[1])
    try:
        check_mesh_model(spec, facts)
    except PlanError as error:
        return str(error)
    return ""
