"""Memory per rank over the step: static bytes, activations, unsharded parameters, p2p buffers.

Accounting. Static bytes (parameters, gradients, optimizer state of the
rank's stages) are held all step. F allocates its saved activations when it
starts; I frees its share when it ends and W the rest; B frees all. UNSHARD
holds the stage's unsharded parameters from its start until RESHARD (or the
end of the step). A compute action's scratch (intermediates it frees before
it returns) is held from its start to its end. A send holds its boundary tensor from when it is posted until
the transfer ends; a receive holds its buffer from when it is posted until the
step that consumes it ends. At equal times frees come before allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

from octopipe.ir.program import SENDS, Program
from octopipe.simulate.bind import Bound
from octopipe.simulate.engine import Timing

__all__ = ["MemoryUse", "memory_events", "memory_use"]


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryUse:
    """One rank's memory: peaks, and when the total first goes over ``cap_bytes``."""

    static_bytes: int
    peak_activation_bytes: int
    peak_bytes: int
    peak_time_us: float
    peak_step: int
    over_cap_time_us: float | None = None
    over_cap_step: int | None = None


def memory_events(program: Program, timing: Timing, bound: Bound, rank: int) -> list[tuple[float, int]]:
    """The rank's memory changes as (time, net bytes at that time), sorted by time.

    Frees come before allocations at equal times, so the total after a time's
    net change is the most held at that time.
    """
    deltas: dict[float, int] = {}
    get = deltas.get
    starts, ends = timing.starts[rank], timing.ends[rank]
    allocs, frees, unsharded = bound.allocs[rank], bound.frees[rank], bound.unsharded[rank]
    for step, size in enumerate(allocs):
        if size:
            time = starts[step]
            deltas[time] = get(time, 0) + size
    for step, size in enumerate(frees):
        if size:
            time = ends[step]
            deltas[time] = get(time, 0) - size
    for step, size in enumerate(unsharded):
        if size:
            time = starts[step]
            deltas[time] = get(time, 0) + size
    for step, size in enumerate(bound.released[rank]):
        if size:
            time = ends[step]
            deltas[time] = get(time, 0) - size
    for step, size in enumerate(bound.scratch[rank]):
        if size:
            start, end = starts[step], ends[step]
            deltas[start] = get(start, 0) + size
            deltas[end] = get(end, 0) - size
    codes, sizes, consumer = program.codes[rank], bound.transfer_bytes, program.consumer
    for step, transfer in enumerate(program.transfer_of[rank]):
        if transfer < 0 or not sizes[transfer]:
            continue
        size = sizes[transfer]
        if codes[step] in SENDS:
            held, released = timing.posted_send[transfer], timing.transfer_end[transfer]
        else:
            held, released = timing.posted_recv[transfer], ends[consumer[transfer]]
        deltas[held] = get(held, 0) + size
        deltas[released] = get(released, 0) - size
    if bound.tail_bytes and bound.tail_bytes[rank]:
        start, end = timing.step_time_us, timing.step_time_us + bound.tail_us
        deltas[start] = get(start, 0) + bound.tail_bytes[rank]
        deltas[end] = get(end, 0) - bound.tail_bytes[rank]
    return sorted(deltas.items())


def _allocating_step(program: Program, timing: Timing, bound: Bound, rank: int, time: float) -> int:
    """The first step that allocates bytes at ``time`` on ``rank`` (0 if none does)."""
    starts = timing.starts[rank]
    for step, transfer in enumerate(program.transfer_of[rank]):
        if transfer >= 0:
            if bound.transfer_bytes[transfer]:
                posted = (
                    timing.posted_send[transfer] if program.codes[rank][step] in SENDS else timing.posted_recv[transfer]
                )
                if posted == time:
                    return step
        elif (bound.allocs[rank][step] or bound.unsharded[rank][step] > 0 or bound.scratch[rank][step]) and starts[
            step
        ] == time:
            return step
    if bound.tail_bytes and bound.tail_bytes[rank] and time == timing.step_time_us:
        return len(starts) - 1  # the tied-gradient exchange, after the rank's last action
    return 0


def memory_use(program: Program, timing: Timing, bound: Bound, rank: int, cap_bytes: int | None) -> MemoryUse:
    """Peaks of one rank (activations alone, and everything), and the first time over the cap."""
    starts = timing.starts[rank]
    allocs, frees = bound.allocs[rank], bound.frees[rank]
    live = peak_activation = 0
    activation_time, activation_step = 0.0, 0
    for step in range(len(starts)):
        size = allocs[step]
        if size:
            live += size
            if live > peak_activation:
                peak_activation, activation_time, activation_step = live, starts[step], step
        live -= frees[step]
    static = bound.static_bytes[rank]
    simple = (
        not any(bound.unsharded[rank])
        and not any(bound.released[rank])
        and not any(bound.scratch[rank])
        and not any(transfer >= 0 and bound.transfer_bytes[transfer] for transfer in program.transfer_of[rank])
        and not (bound.tail_bytes and bound.tail_bytes[rank])
    )
    if simple and (cap_bytes is None or static + peak_activation <= cap_bytes):
        return MemoryUse(
            static_bytes=static,
            peak_activation_bytes=peak_activation,
            peak_bytes=static + peak_activation,
            peak_time_us=activation_time,
            peak_step=activation_step,
        )
    total = peak = static
    peak_time = 0.0
    over_time: float | None = 0.0 if cap_bytes is not None and static > cap_bytes else None
    for time, delta in memory_events(program, timing, bound, rank):
        total += delta
        if total > peak:
            peak, peak_time = total, time
        if over_time is None and cap_bytes is not None and total > cap_bytes:
            over_time = time
    return MemoryUse(
        static_bytes=static,
        peak_activation_bytes=peak_activation,
        peak_bytes=peak,
        peak_time_us=peak_time,
        peak_step=_allocating_step(program, timing, bound, rank, peak_time) if peak > static else 0,
        over_cap_time_us=over_time,
        over_cap_step=None if over_time is None else _allocating_step(program, timing, bound, rank, over_time),
    )
