"""The program: a Plan compiled once into per-rank lists that every consumer runs.

``compile_plan`` reads the proto once into per-rank lists (no protobuf access
after this) and checks, rank by rank and in program order, that every action's
inputs exist before it; then that every micro-batch has exactly one F and one B
(or I and W) on every stage; then pairs sends with receives. The result, a
:class:`Program`, is what the simulator times (``octopipe.simulate``), what the
verifier checks and what the runtime interprets (``octopipe.execute``): one
meaning of a plan.

What an action means, for all of them:

* a compute action (F, I, W, B, OVERLAP_F_B) runs on the rank's compute
  stream, one at a time, in program order; it first waits for the transfers it
  consumes (``waits``, ``overlap_waits``) and for the UNSHARDs of its stages
  (``unshard_waits``);
* RECV posts the receive at its place in the program and never blocks the
  program; the data is waited for by the compute action that consumes it;
* SEND starts the send at its place (after the data was computed) and never
  blocks; every send of a step completes by the end of the step;
* every channel (source rank -> destination rank) completes its messages
  strictly in the order they are issued, as NCCL runs a communicator's
  operations on one stream: the runtime gives each direction between two ranks
  its own communicator (channel), so the k-th send on a channel meets the k-th
  receive posted on it, and a receive posted early never holds up a send in the
  other direction. A plan is accepted only if every channel's receives are
  posted in the order its sends are issued (``DeadlockError`` names the rank,
  step and action where they part); so a plan that passes runs under NCCL's
  in-order completion and under the runtime's strict-order gloo mode alike.
  Each transfer waits for the previous transfer on its channel (``previous``);
* UNSHARD, RESHARD and REDUCE_GRAD run in program order on the rank's
  collective stream.

Collectives act on one stage of the rank. Every replica of a pipeline rank
runs the same program, so the members of a data-parallel group issue the same
collectives in the same order by construction; the rules checked here are per
program:

* with a mesh of dp > 1 every stage's parameters are sharded: each of its
  computations needs an UNSHARD of it before, with no RESHARD in between, and
  the stage needs its REDUCE_GRAD (its replicas' gradients must be combined
  before the optimizer step); without data parallelism the three are optional
  (the runtime has nothing to gather or reduce), and a stage that has an
  UNSHARD follows the same rules;
* UNSHARD only while sharded, RESHARD only while unsharded;
* REDUCE_GRAD at most once per stage and after the stage's last computation
  (nothing of the stage computes after its gradients were reduced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NoReturn

from octopipe.ir.actions import Action, action_from_proto
from octopipe.ir.errors import ActionCountError, DeadlockError, MissingInputError, VerificationError
from octopipe.ir.mesh import mesh_spec
from octopipe.ir.plan import validate_plan
from octopipe.plan.v1 import plan_pb2

__all__ = ["Label", "Program", "compile_plan", "label_text", "message_id", "stream_of"]

# Action kinds by their octopipe.plan.v1.ActionKind numbers.
F: Final[int] = plan_pb2.ACTION_KIND_FORWARD
I: Final[int] = plan_pb2.ACTION_KIND_BACKWARD_INPUT  # noqa: E741 (the torch code)
W: Final[int] = plan_pb2.ACTION_KIND_BACKWARD_WEIGHT
B: Final[int] = plan_pb2.ACTION_KIND_FULL_BACKWARD
OVERLAP: Final[int] = plan_pb2.ACTION_KIND_OVERLAP_F_B
SEND_F: Final[int] = plan_pb2.ACTION_KIND_SEND_F
RECV_F: Final[int] = plan_pb2.ACTION_KIND_RECV_F
SEND_B: Final[int] = plan_pb2.ACTION_KIND_SEND_B
RECV_B: Final[int] = plan_pb2.ACTION_KIND_RECV_B
UNSHARD: Final[int] = plan_pb2.ACTION_KIND_UNSHARD
RESHARD: Final[int] = plan_pb2.ACTION_KIND_RESHARD
REDUCE_GRAD: Final[int] = plan_pb2.ACTION_KIND_REDUCE_GRAD
CODES: Final[dict[int, str]] = {
    F: "F",
    I: "I",
    W: "W",
    B: "B",
    SEND_F: "SEND_F",
    RECV_F: "RECV_F",
    SEND_B: "SEND_B",
    RECV_B: "RECV_B",
    UNSHARD: "UNSHARD",
    RESHARD: "RESHARD",
    REDUCE_GRAD: "REDUCE_GRAD",
}
STAGE_WIDE: Final = frozenset({UNSHARD, RESHARD, REDUCE_GRAD})
SENDS: Final = frozenset({SEND_F, SEND_B})
P2P: Final = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})
COMPUTE: Final = frozenset({F, I, W, B, OVERLAP})
_UPWARD: Final = frozenset({SEND_F, RECV_B})

# (kind, stage, micro-batch) -- micro-batch -1 for stage-wide kinds -- or, for
# OVERLAP_F_B, (OVERLAP, forward stage, forward micro-batch, backward kind,
# backward stage, backward micro-batch).
Label = tuple[int, ...]


def label_text(label: Label) -> str:
    """The torch-style text of a label, e.g. ``2F0`` or ``(0F3;3B1)OVERLAP_F_B``."""
    kind = label[0]
    if kind == OVERLAP:
        return f"({label[1]}F{label[2]};{label[4]}{CODES[label[3]]}{label[5]})OVERLAP_F_B"
    if kind in STAGE_WIDE:
        return f"{label[1]}{CODES[kind]}"
    return f"{label[1]}{CODES[kind]}{label[2]}"


def stream_of(kind: int) -> str:
    """The stream an action kind runs on: compute, send, recv or collective."""
    if kind <= OVERLAP:
        return "compute"
    if kind in SENDS:
        return "send"
    if kind in P2P:
        return "recv"
    return "collective"


def message_id(label: Label) -> tuple[int, int, int]:
    """(SEND_F or SEND_B, stage of the sender, micro-batch): the same on both ends of a message."""
    kind, stage, mb = label[0], label[1], label[2]
    if kind == RECV_F:
        return (SEND_F, stage - 1, mb)
    if kind == RECV_B:
        return (SEND_B, stage + 1, mb)
    return (kind, stage, mb)


@dataclass(eq=False)
class Program:
    """Per-rank lists indexed by step, and per-transfer lists indexed by transfer id."""

    plan: plan_pb2.Plan
    placement: list[int]
    num_microbatches: int
    labels: list[list[Label]]
    codes: list[list[int]]
    # Compute steps: the transfer (id) they wait for, or -1; an OVERLAP_F_B's
    # second transfer; the same-rank UNSHARD steps they wait for (sparse).
    waits: list[list[int]]
    overlap_waits: list[dict[int, int]]
    unshard_waits: list[dict[int, tuple[int, ...]]]
    # SEND/RECV steps: their transfer id (-1 elsewhere).
    transfer_of: list[list[int]]
    # Transfers: the sending and receiving (rank, step), the step that consumes
    # the data on the receiver, the previous transfer on the same channel, and
    # the stage whose boundary tensor moves.
    sender: list[tuple[int, int]]
    receiver: list[tuple[int, int]]
    consumer: list[int]
    previous: list[int]
    boundary_stage: list[int]
    # The mesh: data-parallel and expert-parallel degrees (1 and 1 without a mesh),
    # and the stages that use explicit unsharding (have an UNSHARD).
    dp: int = 1
    ep: int = 1
    sharded_stages: frozenset[int] = frozenset()

    @property
    def num_ranks(self) -> int:
        return len(self.codes)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_transfers(self) -> int:
        return len(self.sender)

    def text(self, rank: int, step: int) -> str:
        return label_text(self.labels[rank][step])

    def actions(self, rank: int) -> list[Action]:
        """A rank's steps as Action objects, in program order (what the runtime interprets)."""
        return [action_from_proto(message) for message in self.plan.ranks[rank].actions]

    def transfers_waited(self, rank: int, step: int) -> list[int]:
        """The transfers a compute step consumes."""
        found = [self.waits[rank][step], self.overlap_waits[rank].get(step, -1)]
        return [transfer for transfer in found if transfer >= 0]


def _read(plan: plan_pb2.Plan) -> list[list[Label]]:
    rows: list[list[Label]] = []
    for program in plan.ranks:
        row: list[Label] = []
        append = row.append
        for action in program.actions:
            kind = action.kind
            if kind == OVERLAP:
                subs = action.sub_actions
                if len(subs) != 2:
                    _invalid(plan)
                f, b = subs
                append((OVERLAP, f.stage_index, f.microbatch_index, b.kind, b.stage_index, b.microbatch_index))
            elif kind in STAGE_WIDE:
                append((kind, action.stage_index, -1))
            else:
                append((kind, action.stage_index, action.microbatch_index))
        rows.append(row)
    return rows


def _invalid(plan: plan_pb2.Plan) -> NoReturn:
    validate_plan(plan)  # raises PlanError with its message
    raise VerificationError(plan, 0, 0, "", "the plan is malformed: run validate_plan for details")


def _check_rank(c: _Compiler, rank: int) -> dict[Label, int]:
    """Walk one rank's program in order, checking each step against what ran before it.

    Fills the compiler's per-step lists for the rank and returns where each
    computation and p2p action ran (label -> step).
    """
    row = c.labels[rank]
    placement, last, m = c.placement, c.num_stages - 1, c.num_microbatches
    waits_row, tid_row = c.waits[rank], c.transfer_of[rank]
    overlap_row, unshard_row = c.overlap_waits[rank], c.unshard_waits[rank]
    consumer, receiver, boundary = c.consumer, c.receiver, c.boundary_stage
    outgoing: dict[int, list[int]] = {}
    incoming: dict[int, list[int]] = {}
    seen: dict[Label, int] = {}
    if c.dp > 1:  # a mesh shards every stage's parameters over its data-parallel group
        fsdp = {s for s in range(c.num_stages) if placement[s] == rank}
    else:
        fsdp = {label[1] for label in row if label[0] == UNSHARD}
    unsharded: dict[int, int] = {}
    reduced: dict[int, int] = {}

    def fail(step: int, problem: str, error: type[VerificationError] = VerificationError) -> NoReturn:
        raise error(c.plan, rank, step, label_text(row[step]), problem)

    def missing(step: int, what: str, fix: str) -> NoReturn:
        fail(step, f"{what} is not produced before this step: {fix}", MissingInputError)

    def once(step: int, label: Label) -> None:
        if label in seen:
            fail(step, f"{label_text(label)} already ran at step {seen[label]}: remove one", ActionCountError)

    def computation(step: int, kind: int, s: int, mb: int) -> int:
        """Check one F, I, W or B; return the transfer it consumes, or -1."""
        if not (0 <= s <= last and placement[s] == rank and 0 <= mb < m):
            _invalid(c.plan)
        if reduced and s in reduced:
            fail(
                step,
                f"stage {s}'s gradients were reduced at step {reduced[s]}: move REDUCE_GRAD after its last backward",
            )
        if kind == F:
            if s == 0:
                return -1
            if placement[s - 1] == rank:
                if (F, s - 1, mb) not in seen:
                    missing(step, f"the output of {s - 1}F{mb}", "run it earlier")
                return -1
            recv = seen.get((RECV_F, s, mb))
            if recv is None:
                missing(step, "its input", f"add {s}RECV_F{mb} before this step")
        elif kind == W:
            if (B, s, mb) in seen:
                fail(step, f"{s}B{mb} already computed this weight gradient", ActionCountError)
            if (I, s, mb) not in seen:
                missing(step, f"the input backward {s}I{mb}", "run it before the W")
            return -1
        else:
            if ((B if kind == I else I), s, mb) in seen:
                fail(
                    step,
                    f"stage {s} micro-batch {mb} already had its backward: it gets B, or I and W",
                    ActionCountError,
                )
            if (F, s, mb) not in seen:
                missing(step, f"the forward {s}F{mb}", "run it before the backward")
            if s == last:
                return -1
            if placement[s + 1] == rank:
                if (I, s + 1, mb) not in seen and (B, s + 1, mb) not in seen:
                    missing(step, f"the gradient of {s + 1}B{mb} (or {s + 1}I{mb})", "run it earlier")
                return -1
            recv = seen.get((RECV_B, s, mb))
            if recv is None:
                missing(step, "its output gradient", f"add {s}RECV_B{mb} before this step")
        transfer = tid_row[recv]
        consumer[transfer] = step
        return transfer

    def parameters(step: int, s: int) -> int:
        if s not in unsharded:
            missing(step, f"stage {s}'s unsharded parameters", f"put {s}UNSHARD before it (with no RESHARD between)")
        return unsharded[s]

    for step, label in enumerate(row):
        kind = label[0]
        if F <= kind <= B:
            if label in seen:
                once(step, label)
            waits_row[step] = computation(step, kind, label[1], label[2])
            seen[label] = step
            if fsdp and label[1] in fsdp:
                unshard_row[step] = (parameters(step, label[1]),)
        elif SEND_F <= kind <= RECV_B:
            s, mb = label[1], label[2]
            if not (0 <= s <= last and placement[s] == rank and 0 <= mb < m):
                _invalid(c.plan)
            peer_stage = s + 1 if kind in _UPWARD else s - 1
            if not 0 <= peer_stage <= last:
                fail(step, f"stage {s} has no {'next' if peer_stage > last else 'previous'} stage to talk to")
            peer = placement[peer_stage]
            if peer == rank:
                fail(
                    step,
                    f"stages {s} and {peer_stage} are both on rank {rank}: same-rank stages hand over "
                    "without communication; remove this action",
                )
            if label in seen:
                once(step, label)
            if kind in SENDS:
                if kind == SEND_F and (F, s, mb) not in seen:
                    missing(step, f"the output of {s}F{mb}", "send after the forward")
                if kind == SEND_B and (I, s, mb) not in seen and (B, s, mb) not in seen:
                    missing(step, f"the input gradient of {s}B{mb} (or {s}I{mb})", "send after it")
                outgoing.setdefault(peer, []).append(step)
            else:
                tid_row[step] = len(receiver)
                receiver.append((rank, step))
                consumer.append(-1)
                boundary.append(peer_stage if kind == RECV_F else s)
                incoming.setdefault(peer, []).append(step)
            seen[label] = step
        elif kind == OVERLAP:
            forward, backward = (F, label[1], label[2]), (label[3], label[4], label[5])
            if backward[0] != I and backward[0] != B:
                _invalid(c.plan)
            once(step, forward)
            once(step, backward)
            first, second = computation(step, F, label[1], label[2]), computation(step, *backward)
            seen[forward] = seen[backward] = step
            waits_row[step] = first if first >= 0 else second
            if first >= 0 and second >= 0:
                overlap_row[step] = second
            if fsdp and (label[1] in fsdp or label[4] in fsdp):
                unshard_row[step] = tuple(parameters(step, s) for s in sorted({label[1], label[4]}) if s in fsdp)
        elif kind in STAGE_WIDE:
            s = label[1]
            if not (0 <= s <= last and placement[s] == rank):
                _invalid(c.plan)
            if kind == UNSHARD:
                if s in unsharded:
                    fail(step, f"stage {s} is already unsharded (step {unsharded[s]}): RESHARD it first")
                unsharded[s] = step
            elif kind == RESHARD:
                if unsharded.pop(s, None) is None:
                    fail(step, f"stage {s} is not unsharded here: remove the RESHARD or UNSHARD before it")
            else:
                if s in reduced:
                    fail(step, f"stage {s}'s gradients were already reduced at step {reduced[s]}")
                reduced[s] = step
        else:
            _invalid(c.plan)
    if c.dp > 1:
        for s in range(c.num_stages):
            if placement[s] == rank and s not in reduced:
                raise ActionCountError(
                    c.plan,
                    rank,
                    len(row),
                    "",
                    f"stage {s} runs on dp={c.dp} data-parallel replicas, so its gradients must be reduced: "
                    f"add {s}REDUCE_GRAD to rank {rank} after the stage's last backward",
                )
    c.sharded |= fsdp
    for peer, steps in outgoing.items():
        c.channels.setdefault((rank, peer), ([], []))[0].extend(steps)
    for peer, steps in incoming.items():
        c.channels.setdefault((peer, rank), ([], []))[1].extend(steps)
    return seen


class _Compiler:
    def __init__(self, plan: plan_pb2.Plan) -> None:
        self.plan = plan
        self.placement = [stage.rank for stage in plan.stages]
        self.num_stages = len(self.placement)
        self.num_microbatches = plan.num_microbatches
        if not self.placement or self.num_microbatches < 1 or any(r >= len(plan.ranks) for r in self.placement):
            _invalid(plan)
        if any(program.rank != index for index, program in enumerate(plan.ranks)):
            _invalid(plan)
        mesh = mesh_spec(plan)  # raises PlanError on a bad mesh
        self.dp, self.ep = mesh.dp, mesh.ep
        self.sharded: set[int] = set()
        self.labels = _read(plan)
        self.waits = [[-1] * len(row) for row in self.labels]
        self.overlap_waits: list[dict[int, int]] = [{} for _ in self.labels]
        self.unshard_waits: list[dict[int, tuple[int, ...]]] = [{} for _ in self.labels]
        self.transfer_of = [[-1] * len(row) for row in self.labels]
        # (source, destination) -> (the sender's SEND steps, the receiver's RECV steps), in program order.
        self.channels: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self.receiver: list[tuple[int, int]] = []
        self.consumer: list[int] = []
        self.boundary_stage: list[int] = []

    def compile(self) -> Program:
        seen = [_check_rank(self, rank) for rank in range(len(self.labels))]
        self.check_coverage(seen)
        sender, previous = self.match()
        return Program(
            plan=self.plan,
            placement=self.placement,
            num_microbatches=self.num_microbatches,
            labels=self.labels,
            codes=[[label[0] for label in row] for row in self.labels],
            waits=self.waits,
            overlap_waits=self.overlap_waits,
            unshard_waits=self.unshard_waits,
            transfer_of=self.transfer_of,
            sender=sender,
            receiver=self.receiver,
            consumer=self.consumer,
            previous=previous,
            boundary_stage=self.boundary_stage,
            dp=self.dp,
            ep=self.ep,
            sharded_stages=frozenset(self.sharded),
        )

    def check_coverage(self, ran: list[dict[Label, int]]) -> None:
        for stage, rank in enumerate(self.placement):
            seen, end = ran[rank], len(self.labels[rank])
            for mb in range(self.num_microbatches):
                if (F, stage, mb) not in seen:
                    problem = f"stage {stage} micro-batch {mb} has no forward: add {stage}F{mb} to rank {rank}"
                elif (B, stage, mb) in seen or ((I, stage, mb) in seen and (W, stage, mb) in seen):
                    continue
                elif (I, stage, mb) in seen:
                    problem = f"stage {stage} micro-batch {mb} has I but no W: add {stage}W{mb} after {stage}I{mb}"
                else:
                    problem = (
                        f"stage {stage} micro-batch {mb} has no backward: add {stage}B{mb} (or {stage}I{mb} and "
                        f"{stage}W{mb}) to rank {rank}"
                    )
                raise ActionCountError(self.plan, rank, end, "", problem)

    def match(self) -> tuple[list[tuple[int, int]], list[int]]:
        sender = [(-1, -1)] * len(self.receiver)
        previous = [-1] * len(self.receiver)
        labels, transfer_of = self.labels, self.transfer_of
        for (source, destination), (sends, recvs) in sorted(self.channels.items()):
            source_labels, destination_labels = labels[source], labels[destination]
            source_tid, destination_tid = transfer_of[source], transfer_of[destination]
            before = -1
            for send_step, recv_step in zip(sends, recvs, strict=False):
                send, recv = source_labels[send_step], destination_labels[recv_step]
                if send[0] == SEND_F:
                    matched = recv[0] == RECV_F and recv[1] == send[1] + 1 and recv[2] == send[2]
                else:
                    matched = recv[0] == RECV_B and recv[1] == send[1] - 1 and recv[2] == send[2]
                if not matched:
                    self.mismatch(source, destination, send_step, recv_step)
                transfer = destination_tid[recv_step]
                sender[transfer] = (source, send_step)
                source_tid[send_step] = transfer
                previous[transfer] = before
                before = transfer
            if len(recvs) > len(sends):
                self.unmatched_recv(source, destination, recvs[len(sends)])
            if len(sends) > len(recvs):
                self.unmatched_send(source, destination, sends[len(recvs)])
        for transfer, step in enumerate(self.consumer):
            if step < 0:
                rank, recv_step = self.receiver[transfer]
                self.deadlock(rank, recv_step, "nothing on this rank uses what it receives: remove it")
        return sender, previous

    def mismatch(self, source: int, destination: int, send_step: int, recv_step: int) -> NoReturn:
        """Explain why the k-th send and the k-th receive of a channel do not belong together."""
        sends, recvs = self.channels[(source, destination)]
        sent = {_matching_recv(self.labels[source][s]) for s in sends}
        posted = {self.labels[destination][r] for r in recvs}
        if self.labels[destination][recv_step] not in sent:
            self.unmatched_recv(source, destination, recv_step)
        if _matching_recv(self.labels[source][send_step]) not in posted:
            self.unmatched_send(source, destination, send_step)
        send = self.labels[source][send_step]
        self.deadlock(
            destination,
            recv_step,
            f"receives from rank {source} are matched in order, so this receive meets {label_text(send)} "
            f"(rank {source}, step {send_step}), which only {label_text(_matching_recv(send))} can take: post the "
            f"receives from rank {source} in the order that rank sends",
        )

    def unmatched_recv(self, source: int, destination: int, recv_step: int) -> NoReturn:
        recv = self.labels[destination][recv_step]
        send = (SEND_F, recv[1] - 1, recv[2]) if recv[0] == RECV_F else (SEND_B, recv[1] + 1, recv[2])
        self.deadlock(
            destination,
            recv_step,
            f"waits for a send that never comes: rank {source} has no {label_text(send)}; add it after the "
            "computation that produces the data",
        )

    def unmatched_send(self, source: int, destination: int, send_step: int) -> NoReturn:
        expected = _matching_recv(self.labels[source][send_step])
        self.deadlock(
            source,
            send_step,
            f"rank {destination} never posts the matching {label_text(expected)}: add it before the step that "
            "uses the data",
        )

    def deadlock(self, rank: int, step: int, problem: str) -> NoReturn:
        raise DeadlockError(self.plan, rank, step, label_text(self.labels[rank][step]), problem)


def _matching_recv(send: Label) -> Label:
    if send[0] == SEND_F:
        return (RECV_F, send[1] + 1, send[2])
    return (RECV_B, send[1] - 1, send[2])


def compile_plan(plan: plan_pb2.Plan) -> Program:
    """Read ``plan`` into a :class:`Program`, rejecting any plan that cannot run.

    Raises MissingInputError, ActionCountError, DeadlockError (unmatched or
    out-of-order sends and receives) or VerificationError; circular waits are
    found when the program runs (``engine.run``).
    """
    return _Compiler(plan).compile()
