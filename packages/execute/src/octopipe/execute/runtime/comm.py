"""Point-to-point communication for one rank's program.

Receives are posted at the start of each step, for every RECV action of the
rank, in the order the *sender* will send them (read from the sender's program
in the Plan), so each pair of ranks matches its messages in the same order on
both sides: irregular plans cannot deadlock on message order, under gloo (tags)
or NCCL (order). Sends are asynchronous and completed at the end of the step.
Receive buffers are allocated once and reused every step. Every wait has a
deadline, and a rank checks the run's abort flag before it waits.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from octopipe.ir import Action, ActionKind

__all__ = ["P2P", "Aborted", "CommTimeout", "message_key"]

_SEND_OF = {ActionKind.RECV_F: ActionKind.SEND_F, ActionKind.RECV_B: ActionKind.SEND_B}


class Aborted(RuntimeError):
    """Another rank failed; this rank stops."""


class CommTimeout(TimeoutError):
    """A message did not arrive (or leave) in time."""


def message_key(action: Action) -> tuple[str, int, int]:
    """(direction, stage of the *sender*, micro-batch): the same on both ends of a message."""
    assert action.microbatch is not None
    if action.kind is ActionKind.SEND_F:
        return ("F", action.stage, action.microbatch)
    if action.kind is ActionKind.RECV_F:
        return ("F", action.stage - 1, action.microbatch)
    if action.kind is ActionKind.SEND_B:
        return ("B", action.stage, action.microbatch)
    if action.kind is ActionKind.RECV_B:
        return ("B", action.stage + 1, action.microbatch)
    raise ValueError(f"{action} is not a point-to-point action")


@dataclass
class _Pending:
    work: dist.Work
    tensor: torch.Tensor
    peer: int


class P2P:
    """Posts, sends and waits for one rank; ``shape_of(key)`` gives each message's buffer shape and dtype.

    ``rank`` and the ranks in ``programs`` and ``stage_rank`` are pipeline
    ranks; with a pp x dp mesh, ``peers`` maps each pipeline rank to the global
    rank of this replica's copy of it, so messages go between matching replicas.
    """

    def __init__(
        self,
        *,
        rank: int,
        programs: dict[int, list[Action]],
        stage_rank: dict[int, int],
        num_microbatches: int,
        buffer_spec: Callable[[tuple[str, int, int]], tuple[torch.Size, torch.dtype]],
        timeout_s: float,
        aborted: Callable[[], str | None],
        group: dist.ProcessGroup | None = None,
        peers: Mapping[int, int] | None = None,
    ) -> None:
        self.rank = rank
        #: pipeline rank -> the process it is for this replica (a mesh's global rank); identity without a mesh
        self.peers = dict(peers) if peers is not None else None
        self.timeout_s = timeout_s
        self.aborted = aborted
        self.group = group
        self.num_microbatches = num_microbatches
        self.num_stages = max(stage_rank) + 1
        # receive order: for each peer, the order that peer sends to us
        mine = {message_key(a): a for a in programs[rank] if a.kind in _SEND_OF}
        self.recv_order: list[tuple[tuple[str, int, int], int]] = []
        for peer in sorted(programs):
            for action in programs[peer]:
                if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B) and message_key(action) in mine:
                    self.recv_order.append((message_key(action), peer))
        missing = set(mine) - {key for key, _ in self.recv_order}
        if missing:
            raise ValueError(f"rank {rank} receives {sorted(missing)} that no rank sends")
        self.buffers = {}
        for key, _ in self.recv_order:
            shape, dtype = buffer_spec(key)
            self.buffers[key] = torch.empty(shape, dtype=dtype)
        self.receives: dict[tuple[str, int, int], _Pending] = {}
        self.sends: list[_Pending] = []

    def _process(self, pipeline_rank: int) -> int:
        return pipeline_rank if self.peers is None else self.peers[pipeline_rank]

    def _tag(self, key: tuple[str, int, int]) -> int:
        direction, stage, microbatch = key
        return ((stage * self.num_microbatches) + microbatch) * 2 + (0 if direction == "F" else 1)

    def post_receives(self) -> None:
        """Post every receive of the step now, in each sender's order."""
        for key, peer in self.recv_order:
            buffer = self.buffers[key]
            work = dist.irecv(buffer, src=self._process(peer), group=self.group, tag=self._tag(key))
            assert work is not None
            self.receives[key] = _Pending(work, buffer, peer)

    def send(self, action: Action, tensor: torch.Tensor, peer: int) -> None:
        """Start sending ``tensor`` for a SEND action; completed by ``finish_sends``."""
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self._process(peer), group=self.group, tag=self._tag(message_key(action)))
        assert work is not None
        self.sends.append(_Pending(work, tensor, peer))

    def receive(self, action: Action, what: str) -> torch.Tensor:
        """Wait for the message a RECV action names; return its (reused) buffer."""
        key = message_key(action)
        pending = self.receives.pop(key, None)
        if pending is None:
            raise RuntimeError(f"{what}: no receive was posted for {action} (is it received twice?)")
        self._wait(pending, f"{what}: waiting for rank {pending.peer}")
        return pending.tensor

    def finish_sends(self, what: str) -> None:
        for pending in self.sends:
            self._wait(pending, f"{what}: sending to rank {pending.peer}")
        self.sends.clear()
        if self.receives:
            unused = sorted(self.receives)
            raise RuntimeError(f"{what}: messages {unused} were received but no RECV action consumed them")

    def _wait(self, pending: _Pending, what: str) -> None:
        # gloo reports completion only through wait(), and a wait that times out breaks the
        # pair, so there is one wait with the whole deadline. A failed peer closes its
        # sockets, which ends this wait at once; the launcher stops ranks stuck elsewhere.
        message = self.aborted()
        if message is not None:
            raise Aborted(f"{what}: stopped because {message}")
        try:
            pending.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            text = str(exc)
            if "Timed out" in text or "timed out" in text:
                raise CommTimeout(f"{what}: nothing arrived within {self.timeout_s:.0f} s") from None
            raise RuntimeError(f"{what}: {text.splitlines()[0]}") from None
