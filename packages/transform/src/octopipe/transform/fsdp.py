"""Fully sharded parameters whose all-gather and reduce-scatter trace into a stage's graphs.

FSDP2 (``torch.distributed.fsdp.fully_shard``) gathers parameters in module
hooks, on its own streams, outside anything AOTAutograd can trace. To get the
collectives *into* the captured graphs (where a pass can move them into
UNSHARD and REDUCE_GRAD graphs, see :mod:`octopipe.transform.fsdp_split`),
:func:`shard_parameters` uses the SimpleFSDP idea: every parameter is stored
as this rank's shard, and reading the module attribute (``linear.weight``)
all-gathers it with torch.distributed's *functional* collectives. The
gradient of that gather is a reduce-scatter, so the backward graph ends in one
reduce-scatter per parameter.

Shards are laid out like FSDP2's: ``layout="dim0"`` chunks dim 0 into
``world`` pieces (``torch.chunk``; the last may be shorter or empty) and pads
each to the first chunk's length, so the unpadded part of rank r's shard *is*
FSDP2's local shard on rank r. ``layout="flat"`` shards the flattened
parameter instead (FSDP1 style: gather, drop the padding, view to the
original shape). ``param_dtype`` casts the shard before the all-gather
(FSDP2's mixed precision: the gather and the compute run in that dtype);
``reduce_dtype`` casts the gradient before the reduce-scatter. Gradients are
averaged over the group (reduce-scatter with ``avg``), as FSDP2 does.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ShardConfig", "ShardSpec", "shard_parameters", "shard_specs", "unshard_tensor"]

_SPECS_ATTRIBUTE = "_octopipe_shard_specs"


@dataclass(kw_only=True, frozen=True)
class ShardConfig:
    """How :func:`shard_parameters` shards and gathers (see the module docstring)."""

    layout: Literal["dim0", "flat"] = "dim0"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("dim0", "flat"):
            raise ValueError(f"layout must be 'dim0' or 'flat', got {self.layout!r}")


@dataclass(kw_only=True, frozen=True)
class ShardSpec:
    """How one parameter is sharded: enough to gather it and to reduce-scatter its gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Literal["dim0", "flat"]
    world: int
    rank: int
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    @property
    def rows(self) -> int:
        """dim-0 length (dim0 layout) or element count (flat layout) of the unpadded parameter."""
        return self.shape[0] if self.layout == "dim0" else math.prod(self.shape)

    @property
    def shard_rows(self) -> int:
        """Rows (or elements) per rank after padding: the first chunk's length, as FSDP2 pads."""
        return math.ceil(self.rows / self.world) if self.rows else 0

    @property
    def padding(self) -> int:
        return self.shard_rows * self.world - self.rows


def _shard(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    data = param.detach().reshape(-1) if spec.layout == "flat" else param.detach()
    chunks = list(torch.chunk(data, spec.world, dim=0))
    mine = chunks[spec.rank] if spec.rank < len(chunks) else data[:0]
    pad = spec.shard_rows - mine.shape[0]
    if pad:
        mine = torch.cat([mine, mine.new_zeros((pad, *mine.shape[1:]))])
    return mine.clone()


def _gather(x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), spec.world, spec.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _reduce_scatter(x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    out = torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "avg", spec.world, spec.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _Unshard(torch.autograd.Function):
    """shard -> (cast) -> all-gather -> wait -> unpad -> (view); backward: (cast) -> (flatten) -> pad -> reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        ctx.spec = spec
        ctx.shard_dtype = shard.dtype
        x = shard.to(spec.param_dtype) if spec.param_dtype is not None else shard
        full = _gather(x, spec)
        if spec.padding:
            full = full[: spec.rows]
        return full.view(spec.shape) if spec.layout == "flat" else full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        spec: ShardSpec = ctx.spec
        g = grad.to(spec.reduce_dtype) if spec.reduce_dtype is not None else grad
        if spec.layout == "flat":
            g = g.reshape(-1)
        if spec.padding:
            g = F.pad(g, [0, 0] * (g.dim() - 1) + [0, spec.padding])
        shard_grad = _reduce_scatter(g, spec)
        if shard_grad.dtype != ctx.shard_dtype:
            shard_grad = shard_grad.to(ctx.shard_dtype)
        return shard_grad, None


def unshard_tensor(shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's ``shard`` (a collective: every rank must call it). No autograd."""
    with torch.no_grad():
        full = _gather(shard.detach(), spec)[: spec.rows]
    return full.reshape(spec.shape)


def _sharded_class(cls: type[nn.Module], names: list[str]) -> type[nn.Module]:
    def getter(name: str) -> property:
        def read(self: nn.Module) -> torch.Tensor:
            specs: dict[str, ShardSpec] = getattr(self, _SPECS_ATTRIBUTE)
            full: torch.Tensor = _Unshard.apply(self._parameters[name], specs[name])
            return full

        return property(read)

    return type(f"Sharded{cls.__name__}", (cls,), {name: getter(name) for name in names})


def shard_parameters(
    module: nn.Module,
    group: dist.ProcessGroup,
    *,
    config: ShardConfig | None = None,
    exclude: Collection[str] = (),
) -> dict[str, ShardSpec]:
    """Shard every parameter of ``module`` over ``group`` in place; return each one's :class:`ShardSpec` by name.

    Afterwards ``module.named_parameters()`` yields the shards under the
    original names, and reading a parameter attribute all-gathers it (so the
    module still runs eagerly, and AOTAutograd traces the collectives).
    Every rank must call this with identical parameters (build the model with
    the same seed first). Tied parameters are refused. Parameters named in
    ``exclude`` (full dotted names) stay whole and local, e.g. expert weights
    that expert parallelism already splits over the group; every name must exist.
    """
    config = config or ShardConfig()
    names = {name for name, _ in module.named_parameters()}
    unknown = sorted(set(exclude) - names)
    if unknown:
        raise ValueError(f"exclude names parameters the module does not have: {unknown}")
    world, rank, group_name = dist.get_world_size(group), dist.get_rank(group), str(group.group_name)
    seen: dict[int, str] = {}
    specs: dict[str, ShardSpec] = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, _SPECS_ATTRIBUTE):
            raise ValueError(f"module {prefix or '<root>'!r} is sharded already: shard a model once")
        local: dict[str, ShardSpec] = {}
        for name, param in list(sub.named_parameters(recurse=False)):
            full_name = f"{prefix}.{name}" if prefix else name
            if id(param) in seen:
                raise ValueError(
                    f"parameters {seen[id(param)]!r} and {full_name!r} are the same tensor (tied): untie them before sharding"
                )
            seen[id(param)] = full_name
            if full_name in exclude:
                continue
            spec = ShardSpec(
                shape=tuple(param.shape),
                dtype=param.dtype,
                layout=config.layout,
                world=world,
                rank=rank,
                group_name=group_name,
                param_dtype=config.param_dtype,
                reduce_dtype=config.reduce_dtype,
            )
            sub.register_parameter(name, nn.Parameter(_shard(param, spec), requires_grad=param.requires_grad))
            local[name] = spec
            specs[full_name] = spec
        if local:
            object.__setattr__(sub, _SPECS_ATTRIBUTE, local)
            sub.__class__ = _sharded_class(type(sub), list(local))
    return specs


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """The :class:`ShardSpec` of every sharded parameter of ``module``, by name (empty if none is sharded)."""
    found: dict[str, ShardSpec] = {}
    for prefix, sub in module.named_modules():
        for name, spec in getattr(sub, _SPECS_ATTRIBUTE, {}).items():
            found[f"{prefix}.{name}" if prefix else name] = spec
    return found
