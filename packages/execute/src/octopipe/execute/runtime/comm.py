"""Point-to-point communication for one rank's program, as the program says: strict order per channel.

The compiled program (:mod:`octopipe.ir.program`) decides everything: a RECV
action posts its receive where it stands in the program, the computation that
consumes the data waits for it, a SEND starts where it stands, and every send
of a step completes by the end of the step. Each channel (this rank -> a peer,
or a peer -> this rank) completes its operations strictly in the order they
were issued, as NCCL completes the operations of one communicator on its
stream: a channel's next operation starts only when the previous one has
completed. One thread per channel does this, so issuing never blocks the
program, exactly as the simulator models it; the program compiler has checked
that every channel's receives are posted in its send order, so the strict
order cannot deadlock. Messages carry their transfer id as the tag (the same
on both ends: both compile the same plan), so a mismatch would hang rather
than deliver the wrong tensor — and every wait has a deadline.

Each direction between two ranks is its own process group
(:func:`channel_groups`), on gloo as on NCCL: NCCL ignores tags and runs one
communicator's operations in order on one stream, so a sender -> receiver
channel that shared its communicator with the opposite direction could wait
behind a receive the peer posts later; with a communicator per direction the
k-th send of a channel meets the k-th receive posted on it, which is what the
program compiler verified. On CUDA torch's NCCL process group runs the
operations on its own streams, ordered against the compute stream with
events: a send waits for the kernels that made its tensor, the compute that
consumes a receive waits for the receive; the host never blocks on the GPU.

A transfer may carry several tensors (a whole-model stage's boundary: hidden
states, router logits, ...): they go in order, one after the other, on the
transfer's channel thread under the transfer's tag, so the channel still
completes its transfers in issue order.

Memory is held as the simulator counts it: a receive's buffers are allocated
when it is posted (and freed when the computation that consumed them no longer
needs them); a send's tensors are let go as soon as the send completes.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from octopipe.ir.program import Program
from octopipe.transform.device import CPU, Device

__all__ = ["Aborted", "BufferSpec", "Channels", "CommTimeout", "channel_groups", "program_channels"]

#: a receive buffer's shape and dtype
BufferSpec = tuple[torch.Size, torch.dtype]

#: how often a waiting rank looks at the run's abort flag
_POLL_S = 0.2


class Aborted(RuntimeError):
    """Another rank failed; this rank stops."""


class CommTimeout(TimeoutError):
    """A message did not arrive (or leave) in time."""


@dataclass(eq=False)
class _Op:
    transfer: int
    tensors: tuple[torch.Tensor, ...]
    send: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""


#: (source, destination) global ranks -> the process group of that direction
ChannelGroups = Mapping[tuple[int, int], dist.ProcessGroup]


def program_channels(program: Program) -> list[tuple[int, int]]:
    """The directions (sending rank, receiving rank) a program's messages take, sorted: the same on every
    rank (each compiles the same plan)."""
    return sorted({(program.sender[t][0], program.receiver[t][0]) for t in range(program.num_transfers)})


def channel_groups(directions: Sequence[tuple[int, int]]) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One process group per direction (global ranks), created by every process of the world in the same
    order (``dist.new_group`` is collective): call it on every rank with the same ``directions``. Returns the
    groups this process is a member of."""
    me = dist.get_rank()
    groups = {}
    for source, destination in sorted(set(directions)):
        if source == destination:
            raise ValueError(f"a channel from rank {source} to itself: a rank sends nothing to itself")
        group = dist.new_group([source, destination])
        if me in (source, destination):
            assert isinstance(group, dist.ProcessGroup)
            groups[(source, destination)] = group
    return groups


class _Channel:
    """One direction between this rank and a peer: a thread that runs its operations one after the other."""

    def __init__(
        self,
        name: str,
        issue: Callable[[_Op, torch.Tensor], dist.Work],
        timeout_s: float,
        log: list[int],
        device: Device,
    ) -> None:
        self.ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self.issue, self.timeout_s, self.log, self.device = issue, timeout_s, log, device
        self.broken = ""
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with self.device.current():  # a thread's current GPU is its own: the rank's, as on the program's thread
            self._run()

    def _run(self) -> None:
        while (op := self.ops.get()) is not None:
            if not self.broken:
                try:
                    self.log.append(op.transfer)
                    # one transfer's tensors in order, each done before the next; no reference to a tensor
                    # stays on this thread, so the program's thread frees them (the allocator meter sees it)
                    for index in range(len(op.tensors)):
                        work = self.issue(op, op.tensors[index])
                        work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
                        del work  # no gloo work may outlive the process group (torch aborts at exit otherwise)
                except RuntimeError as exc:
                    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    self.broken = "timed out" if "imed out" in text else text
            op.error = self.broken
            done = op.done
            del op  # before the program may see it done: the last reference (and the free) is the program's
            done.set()

    def close(self, timeout_s: float) -> None:
        self.ops.put(None)
        self.thread.join(timeout=timeout_s)


class Channels:
    """The point-to-point operations of one rank's program (``rank`` is its pipeline rank).

    ``buffer_spec(transfer)`` gives a receive buffer's shape and dtype, or a
    list of them for a transfer that carries several tensors. With a
    pp x dp mesh, ``peers`` maps each pipeline rank to the global rank of this
    replica's copy of it, so messages go between matching replicas. Receive
    buffers are made on ``device`` (the rank's). ``groups`` gives each
    direction's process group (:func:`channel_groups`, global ranks); without
    it every channel uses the default group (gloo only: tags keep the
    directions apart there).
    """

    def __init__(
        self,
        *,
        program: Program,
        rank: int,
        buffer_spec: Callable[[int], BufferSpec | Sequence[BufferSpec]],
        timeout_s: float,
        aborted: Callable[[], str | None],
        groups: ChannelGroups | None = None,
        peers: Mapping[int, int] | None = None,
        device: Device = CPU,
    ) -> None:
        self.program, self.rank, self.device = program, rank, device
        self.peers = dict(peers) if peers is not None else None
        self.buffer_spec, self.timeout_s, self.aborted, self.groups = buffer_spec, timeout_s, aborted, groups
        #: channel ("send", peer) or ("recv", peer) -> the transfers in the order they started, over all steps
        self.started: dict[tuple[str, int], list[int]] = {}
        self._channels: dict[tuple[str, int], _Channel] = {}
        self._pending: dict[int, _Op] = {}

    def _process(self, pipeline_rank: int) -> int:
        return pipeline_rank if self.peers is None else self.peers[pipeline_rank]

    def _channel(self, direction: str, peer: int) -> _Channel:
        key = (direction, peer)
        channel = self._channels.get(key)
        if channel is None:
            log = self.started.setdefault(key, [])
            process = self._process(peer)
            me = self._process(self.rank)
            direction_key = (me, process) if direction == "send" else (process, me)
            group = None if self.groups is None else self.groups.get(direction_key)
            if self.groups is not None and group is None:
                raise RuntimeError(
                    f"no process group for the channel from rank {direction_key[0]} to "
                    f"{direction_key[1]}: the plan's messages take a direction opened for none"
                )

            def issue(op: _Op, tensor: torch.Tensor) -> dist.Work:
                call = dist.isend if op.send else dist.irecv
                work = call(tensor, process, group=group, tag=op.transfer)
                assert work is not None
                return work

            name = f"octopipe-{direction}-{'to' if direction == 'send' else 'from'}-{peer}"
            channel = self._channels[key] = _Channel(name, issue, self.timeout_s, log, self.device)
        return channel

    def post_recv(self, transfer: int) -> torch.Tensor:
        """Post the receive of ``transfer`` (a RECV action) of one tensor; return its buffer, valid after ``wait``."""
        (buffer,) = self.post_recv_all(transfer)
        return buffer

    def send(self, transfer: int, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` for ``transfer`` (a SEND action); it completes by ``finish``."""
        self.send_all(transfer, [tensor])

    def post_recv_all(self, transfer: int) -> list[torch.Tensor]:
        """Post the receive of ``transfer``, every tensor it carries; return the buffers, valid after ``wait``."""
        self._release_sent()
        spec = self.buffer_spec(transfer)
        single = isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype)
        specs: Sequence[BufferSpec] = [spec] if single else spec  # type: ignore[list-item,assignment]
        buffers = [self.device.empty(shape, dtype) for shape, dtype in specs]
        peer = self.program.sender[transfer][0]
        op = _Op(transfer, tuple(buffers), send=False)
        self._pending[transfer] = op
        self._channel("recv", peer).ops.put(op)
        return list(buffers)

    def send_all(self, transfer: int, tensors: Sequence[torch.Tensor]) -> None:
        """Start sending ``tensors`` (in order) for ``transfer`` (a SEND action); it completes by ``finish``."""
        self._release_sent()
        peer = self.program.receiver[transfer][0]
        op = _Op(transfer, tuple(t.contiguous() for t in tensors), send=True)
        self._pending[-1 - transfer] = op  # sends and receives of one transfer never meet on one rank
        self._channel("send", peer).ops.put(op)

    def wait(self, transfer: int, what: str) -> None:
        """Wait until the receive of ``transfer`` has completed (before the computation that consumes it)."""
        op = self._pending.pop(transfer, None)
        assert op is not None, f"transfer {transfer} waited for without a posted receive"
        self._wait(op, f"{what}: waiting for rank {self.program.sender[transfer][0]}")
        self._release_sent()

    def _release_sent(self) -> None:
        """Let go of the tensors of every send that has completed (on the program's thread, as the
        simulator counts a send: held until its transfer ends); the op stays pending until ``finish``."""
        for op in self._pending.values():
            if op.send and op.tensors and op.done.is_set():
                op.tensors = ()

    def finish(self, what: str) -> None:
        """Wait for every operation still in flight (the step's sends); none may be left afterwards."""
        for key in sorted(self._pending):
            op = self._pending.pop(key)
            peer = self.program.receiver[op.transfer][0] if op.send else self.program.sender[op.transfer][0]
            self._wait(op, f"{what}: {'sending to' if op.send else 'receiving from'} rank {peer}")

    def close(self) -> None:
        """Stop the channel threads and wait for them (after the last step, before the group is destroyed)."""
        for channel in self._channels.values():
            channel.close(self.timeout_s)
        self._pending.clear()

    def _wait(self, op: _Op, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not op.done.wait(_POLL_S):
            message = self.aborted()
            if message is not None:
                raise Aborted(f"{what}: stopped because {message}")
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what}: nothing arrived within {self.timeout_s:.0f} s")
        if op.error:
            if op.error == "timed out":
                raise CommTimeout(f"{what}: nothing arrived within {self.timeout_s:.0f} s")
            raise RuntimeError(f"{what}: {op.error}")
