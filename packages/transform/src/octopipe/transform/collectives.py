"""Recognising torch.distributed functional collectives (and the cheap ops around them) in FX graphs.

Graph passes match ops by their overload packet, so ``aten.view.default``
and ``aten.view.dtype`` both count as a view. Only the ``_c10d_functional``
namespace is recognised: those are what AOTAutograd traces for
``torch.distributed._functional_collectives`` and what runs asynchronously
(the op issues the collective and returns at once; ``wait_tensor`` blocks).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import fx

__all__ = [
    "COLLECTIVE_KINDS",
    "is_all_gather",
    "is_all_to_all",
    "is_cast",
    "is_collective",
    "is_layout",
    "is_reduce_scatter",
    "is_scale",
    "is_wait",
    "packet",
]

_functional = torch.ops._c10d_functional
_aten = torch.ops.aten

#: collective kinds by overload packet name (read-only)
COLLECTIVE_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all",
        "all_reduce": "all_reduce",
        "all_gather_into_tensor_coalesced": "all_gather_coalesced",
        "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
        "all_reduce_coalesced": "all_reduce_coalesced",
    }
)

# ops that only move, pad, cut or reinterpret data (no arithmetic); transposes are left out on purpose,
# so a weight's ``t()`` for a matmul stays with the compute that uses it
_LAYOUT = frozenset(
    getattr(_aten, name)
    for name in (
        "view",
        "reshape",
        "_unsafe_view",
        "_reshape_alias",
        "alias",
        "clone",
        "contiguous",
        "slice",
        "narrow",
        "constant_pad_nd",
        "cat",
        "split",
        "split_with_sizes",
        "squeeze",
        "unsqueeze",
        "flatten",
    )
    if hasattr(_aten, name)
)
_CASTS = frozenset(
    op
    for op in (getattr(_aten, "_to_copy", None), getattr(torch.ops.prims, "convert_element_type", None))
    if op is not None
)
_SCALE_OVERLOADS = ("mul.Scalar", "div.Scalar")


def packet(node: fx.Node) -> object:
    """The node's overload packet (``aten.view`` for ``aten.view.default``), or its target for other callables."""
    return getattr(node.target, "overloadpacket", node.target)


def _functional_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = packet(node)
    if getattr(target, "_qualified_op_name", "").startswith("_c10d_functional::"):
        return str(getattr(target, "__name__", ""))
    return None


def is_collective(node: fx.Node) -> bool:
    """An op that *issues* a functional collective (its result must pass through ``wait_tensor``)."""
    return _functional_name(node) in COLLECTIVE_KINDS


def is_wait(node: fx.Node) -> bool:
    return _functional_name(node) == "wait_tensor"


def is_all_gather(node: fx.Node) -> bool:
    return _functional_name(node) == "all_gather_into_tensor"


def is_reduce_scatter(node: fx.Node) -> bool:
    return _functional_name(node) == "reduce_scatter_tensor"


def is_all_to_all(node: fx.Node) -> bool:
    return _functional_name(node) == "all_to_all_single"


def is_layout(node: fx.Node) -> bool:
    """A view, reshape, pad, slice, cat/split (and getitem of a split), clone: moves data, no arithmetic."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return packet(node) in _LAYOUT


def is_cast(node: fx.Node) -> bool:
    """A dtype conversion (``_to_copy`` with nothing but a dtype, or ``convert_element_type``)."""
    if node.op != "call_function" or packet(node) not in _CASTS:
        return False
    return set(node.kwargs) <= {"dtype", "layout", "device", "memory_format"}


def is_scale(node: fx.Node) -> bool:
    """Multiplication or division by a Python number (a gradient pre- or post-divide)."""
    if node.op != "call_function":
        return False
    name = str(node.target).removeprefix("aten.")
    return name in _SCALE_OVERLOADS
