"""The timing engine: start and end of every action, or the circular wait that stops the plan.

Model. Each rank runs its program in order. Compute actions (F, I, W, B,
OVERLAP_F_B) run one at a time on the rank's compute stream and block the
program until they end; a compute action starts when the previous one has
ended, the transfers it consumes have arrived and the UNSHARDs it needs are
done. SEND and RECV only post work and never block the program: a transfer
starts when the send is posted (after the data was computed), the receive is
posted, and the previous transfer on the same channel (source -> destination)
has arrived (a channel completes its messages in issue order, as NCCL does on
the communicator the runtime gives each channel); it takes
``latency + bytes / bandwidth``. UNSHARD, RESHARD and REDUCE_GRAD run in order
on the rank's collective stream, from when they are posted.

Every stream is FIFO in program order, so there are no priority decisions:
times are a longest-path computation over the plan's DAG (max and + only),
evaluated in dependency order by a worklist of ranks that each run until they
block on a transfer whose send has not been posted. A rank that can never
continue is part of a circular wait. The same inputs give the same floats,
bit for bit, whatever order the worklist visits ranks in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from octopipe.ir.errors import DeadlockError
from octopipe.ir.program import OVERLAP, P2P, RESHARD, SENDS, Program, label_text

__all__ = ["Timing", "run"]


@dataclass(eq=False)
class Timing:
    """What ``run`` computes. For SEND and RECV steps start/end are the transfer's."""

    starts: list[list[float]]
    ends: list[list[float]]
    busy_us: list[float]
    # Per transfer: when the send and the receive were posted, start and end.
    posted_send: list[float]
    posted_recv: list[float]
    transfer_start: list[float]
    transfer_end: list[float]

    @property
    def step_time_us(self) -> float:
        return max((max(row, default=0.0) for row in self.ends), default=0.0)


def run(program: Program, durations: list[list[float]], transfer_us: list[float]) -> Timing:
    """Time every action; raise DeadlockError naming a circular wait if the plan cannot finish."""
    codes, waits, transfer_of = program.codes, program.waits, program.transfer_of
    overlap_waits, unshard_waits = program.overlap_waits, program.unshard_waits
    previous = program.previous
    count = program.num_transfers
    posted_send = [-1.0] * count
    posted_recv = [-1.0] * count
    t_start = [-1.0] * count
    t_end = [-1.0] * count
    waiter = [-1] * count
    num_ranks = program.num_ranks
    starts = [[0.0] * len(row) for row in codes]
    ends = [[0.0] * len(row) for row in codes]
    position = [0] * num_ranks
    clock = [0.0] * num_ranks
    collective = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        code, wait, tid = codes[rank], waits[rank], transfer_of[rank]
        overlap_wait, unshard_wait = overlap_waits[rank], unshard_waits[rank]
        start, end, duration = starts[rank], ends[rank], durations[rank]
        step, now, spent, n = position[rank], clock[rank], busy[rank], len(code)
        while step < n:
            kind = code[step]
            if kind <= OVERLAP:
                begin = now
                transfer = wait[step]
                if transfer >= 0:
                    arrived = t_end[transfer]
                    if arrived < 0.0:
                        waiter[transfer] = rank
                        break
                    if arrived > begin:
                        begin = arrived
                    if kind == OVERLAP and step in overlap_wait:
                        transfer = overlap_wait[step]
                        arrived = t_end[transfer]
                        if arrived < 0.0:
                            waiter[transfer] = rank
                            break
                        if arrived > begin:
                            begin = arrived
                if unshard_wait and step in unshard_wait:
                    for other in unshard_wait[step]:
                        if end[other] > begin:
                            begin = end[other]
                took = duration[step]
                start[step] = begin
                now = begin + took
                end[step] = now
                spent += took
            elif kind in P2P:
                transfer = tid[step]
                if kind in SENDS:
                    posted_send[transfer] = now
                    ready = posted_recv[transfer] >= 0.0
                else:
                    posted_recv[transfer] = now
                    ready = posted_send[transfer] >= 0.0
                if ready:
                    begin = posted_send[transfer]
                    if posted_recv[transfer] > begin:
                        begin = posted_recv[transfer]
                    before = previous[transfer]
                    if before >= 0:
                        # a channel's receives are posted in its send order (compile_plan), so the
                        # previous transfer had both ends posted before this one: it is timed
                        assert t_end[before] >= 0.0
                        if t_end[before] > begin:
                            begin = t_end[before]
                    t_start[transfer] = begin
                    t_end[transfer] = begin + transfer_us[transfer]
                    if waiter[transfer] >= 0:
                        work.append(waiter[transfer])
                        waiter[transfer] = -1
            else:
                begin = now if now > collective[rank] else collective[rank]
                start[step] = begin
                finish = begin if kind == RESHARD else begin + duration[step]
                end[step] = finish
                collective[rank] = finish
            step += 1
        position[rank], clock[rank], busy[rank] = step, now, spent
    stuck = [rank for rank in range(num_ranks) if position[rank] < len(codes[rank])]
    if stuck:
        _circular_wait(program, stuck, position, t_end)
    for transfer, ((send_rank, send_step), (recv_rank, recv_step)) in enumerate(
        zip(program.sender, program.receiver, strict=True)
    ):
        starts[send_rank][send_step] = starts[recv_rank][recv_step] = t_start[transfer]
        ends[send_rank][send_step] = ends[recv_rank][recv_step] = t_end[transfer]
    return Timing(
        starts=starts,
        ends=ends,
        busy_us=busy,
        posted_send=posted_send,
        posted_recv=posted_recv,
        transfer_start=t_start,
        transfer_end=t_end,
    )


def _circular_wait(
    program: Program,
    stuck: list[int],
    position: list[int],
    t_end: list[float],
) -> NoReturn:
    """Follow who waits for whom from the first stuck rank until a rank repeats."""
    blocked_on: dict[int, int] = {}
    for rank in stuck:
        step = position[rank]
        transfer = next(t for t in program.transfers_waited(rank, step) if t_end[t] < 0.0)
        blocked_on[rank] = transfer
    chain = [stuck[0]]
    while True:
        source = program.sender[blocked_on[chain[-1]]][0]
        if source in chain:
            cycle = chain[chain.index(source) :]
            break
        chain.append(source)
    first = min(cycle)
    order = cycle[cycle.index(first) :] + cycle[: cycle.index(first)]
    links = []
    for rank in order:
        transfer = blocked_on[rank]
        recv_rank, recv_step = program.receiver[transfer]
        send_rank, send_step = program.sender[transfer]
        links.append(
            f"rank {rank} waits at step {position[rank]} ({program.text(rank, position[rank])}) for "
            f"{label_text(program.labels[recv_rank][recv_step])}, which rank {send_rank} only sends at step "
            f"{send_step} ({program.text(send_rank, send_step)})"
        )
    path = " -> ".join(str(r) for r in [*order, order[0]])
    raise DeadlockError(
        program.plan,
        first,
        position[first],
        program.text(first, position[first]),
        f"circular wait between ranks {path}: " + "; ".join(links) + ". Reorder the programs so that each "
        "send comes before the step that waits for the data coming back",
    )
