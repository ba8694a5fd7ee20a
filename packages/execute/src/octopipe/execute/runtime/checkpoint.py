"""Checkpoints of a run: parameters and AdamW state by parameter name, through torch.distributed.checkpoint.

Every rank saves the parameters it owns and their optimizer state under keys
named after the model's parameters (``param/<name>``, ``exp_avg/<name>``,
``exp_avg_sq/<name>``, ``step/<name>``), so a checkpoint does not depend on
the plan that wrote it: a run resumed with another partition or on other
ranks loads each parameter where its new stage lives. Folder ``step-<n>``
holds the state after ``n`` completed steps.

Every save follows the commit protocol of ``octopipe.execute.checkpoint_files``:
the ranks of one launch write ``step-<n>.partial-<token>`` (the token from
:func:`checkpoint_token`, drawn by rank 0 once per launch); when
``dcp.save`` returns on rank 0 its ``.metadata`` is written, so every rank's
data is in, and rank 0 renames the folder to ``step-<n>``. A checkpoint is
complete, and loadable, once ``step-<n>/.metadata`` exists: a save whose
writer died stays a ``.partial-`` folder and is never loaded.
``runtime.checkpointer.Checkpointer`` runs saves in the background.
Loading never unpickles arbitrary objects: tensors only.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from octopipe.execute.checkpoint_files import checkpoint_path, commit_checkpoint, latest_checkpoint, partial_path

__all__ = [
    "checkpoint_path",
    "checkpoint_state",
    "checkpoint_token",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
    "snapshot",
    "write_checkpoint",
]

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def checkpoint_state(
    params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, suffix: str = ""
) -> dict[str, torch.Tensor]:
    """This rank's tensors to save, by key (the live tensors: :func:`snapshot` them to save them later)."""
    state: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state[f"param/{name}{suffix}"] = param.detach()
        slots = optimizer.state.get(param, {})
        for key in _STATE_KEYS:
            if key in slots:
                state[f"{key}/{name}{suffix}"] = slots[key]
    return state


def snapshot(
    state: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Copies of ``state`` on the CPU that later updates cannot change (the optimizer updates in place).

    ``into``: the copies of an earlier snapshot nothing reads any more; tensors of the same key, shape and
    dtype are copied into (no new memory to allocate and fault in), the others are new.
    """
    copies: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        old = into.get(key) if into is not None else None
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            copies[key] = old.copy_(value.detach())
        else:
            copies[key] = value.detach().to("cpu", copy=True)
    return copies


def _rank(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0


def checkpoint_token(process_group: dist.ProcessGroup | None = None) -> str:
    """A short random hex drawn by rank 0 of ``process_group`` and sent to every rank (a collective).

    One per launch: it names the launch's partial folders (``checkpoint_files.partial_path``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return secrets.token_hex(4)
    token = [secrets.token_hex(4) if _rank(process_group) == 0 else None]
    source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(token, src=source, group=process_group)
    assert isinstance(token[0], str)
    return token[0]


class _HeldWriter(dcp.FileSystemWriter):
    """Writes as usual, then holds for ``hold_s`` before reporting the write (the fault tests' window)."""

    def __init__(self, path: Path, hold_s: float) -> None:
        super().__init__(path)
        self.hold_s = hold_s

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        time.sleep(self.hold_s)
        return written


def write_checkpoint(
    state: Mapping[str, torch.Tensor],
    folder: str | Path,
    step: int,
    token: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    hold_s: float = 0.0,
) -> Path | None:
    """Write ``state`` as step ``step``'s checkpoint and commit it (a collective of ``process_group``).

    Every rank writes into ``step-<step>.partial-<token>``; rank 0 of the group renames it to ``step-<step>``
    and returns that folder, the others return None (they may return before the rename). ``hold_s`` (fault
    tests): after writing its data, this rank waits that long before reporting the write.
    """
    partial = partial_path(folder, step, token)
    partial.mkdir(parents=True, exist_ok=True)
    writer = _HeldWriter(partial, hold_s) if hold_s > 0 else dcp.FileSystemWriter(partial)
    dcp.save(dict(state), storage_writer=writer, process_group=process_group)
    if _rank(process_group) != 0:
        return None
    return commit_checkpoint(partial, step)


def save_checkpoint(
    folder: str | Path,
    step: int,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    suffix: str = "",
    token: str = "",
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save this rank's parameters and AdamW state now and commit them (a collective: every rank of the group).

    ``suffix`` tells apart tensors that share a name but not their values across ranks (FSDP shards
    and expert slices of a pp x dp mesh: ``#replica<d>of<dp>``); such a checkpoint resumes on the same dp.
    ``token`` names this launch's partial folders (default: a new one, a collective). Returns
    ``step-<step>``: committed on rank 0's return, maybe not yet on the others'.
    """
    token = token or checkpoint_token(process_group)
    state = checkpoint_state(params, optimizer, suffix)
    write_checkpoint(state, folder, step, token, process_group=process_group)
    return checkpoint_path(folder, step)


def load_checkpoint(
    folder: str | Path,
    step: int,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    suffix: str = "",
) -> None:
    """Load this rank's parameters and AdamW state from the committed ``step-<step>`` in place (a collective)."""
    path = checkpoint_path(folder, step)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"no complete checkpoint at {path}: resume from a step whose folder has .metadata "
            f"(the latest complete one here is step {latest_checkpoint(folder)}; 0: none)"
        )
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
    """Every tensor of the committed checkpoint of ``step``, in one process (for tests and inspection)."""
    path = checkpoint_path(folder, step)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    with tempfile.TemporaryDirectory(prefix="octopipe-ckpt-") as scratch:
        target = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(path), str(target))
        loaded = torch.load(target, weights_only=True)
    return {str(k): v for k, v in loaded.items()}
