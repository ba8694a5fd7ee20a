"""Checkpoints of a run: parameters and AdamW state by parameter name, through torch.distributed.checkpoint.

Every rank saves the parameters it owns and their optimizer state under keys
named after the model's parameters (``param/<name>``, ``exp_avg/<name>``,
``exp_avg_sq/<name>``, ``step/<name>``), so a checkpoint does not depend on
the plan that wrote it: a run resumed with another partition or on other
ranks loads each parameter where its new stage lives. Folder ``step-<n>``
holds the state after ``n`` completed steps; it is complete once its
``.metadata`` file exists (torch.distributed.checkpoint writes it last).
Loading never unpickles arbitrary objects: tensors only.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from octopipe.execute.checkpoint_files import checkpoint_path, latest_checkpoint

__all__ = ["checkpoint_path", "latest_checkpoint", "load_checkpoint", "read_checkpoint", "save_checkpoint"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _state(
    params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, suffix: str
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state[f"param/{name}{suffix}"] = param.detach()
        slots = optimizer.state.get(param, {})
        for key in _STATE_KEYS:
            if key in slots:
                state[f"{key}/{name}{suffix}"] = slots[key]
    return state


def save_checkpoint(
    folder: str | Path,
    step: int,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    suffix: str = "",
) -> Path:
    """Save this rank's parameters and AdamW state (a collective: every rank of the group calls it).

    ``suffix`` tells apart tensors that share a name but not their values across ranks (FSDP shards
    and expert slices of a pp x dp mesh: ``#replica<d>of<dp>``); such a checkpoint resumes on the same dp.
    """
    path = checkpoint_path(folder, step)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(params, optimizer, suffix), checkpoint_id=str(path))
    return path


def load_checkpoint(
    folder: str | Path,
    step: int,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    suffix: str = "",
) -> None:
    """Load this rank's parameters and AdamW state from ``step-<step>`` in place (a collective)."""
    path = checkpoint_path(folder, step)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path}: resume from a step whose folder has .metadata")
    state: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state[f"param/{name}{suffix}"] = torch.empty_like(param.detach())
        state[f"exp_avg/{name}{suffix}"] = torch.zeros_like(param.detach())
        state[f"exp_avg_sq/{name}{suffix}"] = torch.zeros_like(param.detach())
        state[f"step/{name}{suffix}"] = torch.zeros((), dtype=torch.float32)
    dcp.load(state, checkpoint_id=str(path))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[f"param/{name}{suffix}"])
            optimizer.state[param] = {key: state[f"{key}/{name}{suffix}"] for key in _STATE_KEYS}


def read_checkpoint(folder: str | Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in one process (for tests and inspection)."""
    with tempfile.TemporaryDirectory(prefix="octopipe-ckpt-") as scratch:
        target = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(checkpoint_path(folder, step)), str(target))
        loaded = torch.load(target, weights_only=True)
    return {str(k): v for k, v in loaded.items()}
