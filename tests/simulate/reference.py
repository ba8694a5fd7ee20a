"""A slow, independent statement of the simulator's timing model, for cross-checking the engine.

It works on Action objects and a CostModel (no compiled program), pairs sends
with receives per channel by counting, and finds all start times as the least
fixed point of "start = max(what it waits for)" by plain repetition.
"""

from __future__ import annotations

from octopipe.ir import stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import Action, ActionKind, CostModel, rank_actions

COMPUTE = {
    ActionKind.FORWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
    ActionKind.FULL_BACKWARD,
    ActionKind.OVERLAP_F_B,
}
SEND = {ActionKind.SEND_F: ActionKind.RECV_F, ActionKind.SEND_B: ActionKind.RECV_B}


def reference_times(plan: plan_pb2.Plan, costs: CostModel) -> dict[tuple[int, int], tuple[float, float]]:
    """(rank, step) -> (start, end); for SEND and RECV the transfer's."""
    programs = rank_actions(plan)
    placement = stage_ranks(plan)
    # Pair the k-th send on each channel with the k-th receive.
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, program in programs.items():
        for step, action in enumerate(program):
            if action.kind in SEND:
                peer = placement[action.stage + (1 if action.kind is ActionKind.SEND_F else -1)]
                sends.setdefault((rank, peer), []).append(step)
            elif action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                peer = placement[action.stage + (-1 if action.kind is ActionKind.RECV_F else 1)]
                recvs.setdefault((peer, rank), []).append(step)
    # (sender, send step, receiver, recv step, previous transfer on the channel)
    transfers: list[tuple[int, int, int, int, int]] = []
    for channel, steps in sends.items():
        for index, (send_step, recv_step) in enumerate(zip(steps, recvs[channel], strict=True)):
            transfers.append((channel[0], send_step, channel[1], recv_step, len(transfers) - 1 if index else -1))
    by_step = {(t[2], t[3]): i for i, t in enumerate(transfers)}
    by_step.update({(t[0], t[1]): i for i, t in enumerate(transfers)})
    start = {(r, s): 0.0 for r, program in programs.items() for s in range(len(program))}
    end = dict(start)
    for _ in range(sum(len(p) for p in programs.values()) + 2):
        changed = False
        for rank, program in programs.items():
            clock = 0.0  # end of the previous compute
            collective = 0.0
            received: dict[tuple[ActionKind, int, int | None], int] = {}
            unshard: dict[int, int] = {}
            for step, action in enumerate(program):
                key = (rank, step)
                if action.kind in COMPUTE:
                    begin = clock
                    for part in action.computations:
                        needs = []
                        if part.kind is ActionKind.FORWARD:
                            needs.append((ActionKind.RECV_F, part.stage, part.microbatch))
                        elif part.kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
                            needs.append((ActionKind.RECV_B, part.stage, part.microbatch))
                        for need in needs:
                            if need in received:
                                begin = max(begin, end[(rank, received[need])])
                        if part.stage in unshard:
                            begin = max(begin, end[(rank, unshard[part.stage])])
                    duration = _duration(action, costs)
                    new = (begin, begin + duration)
                    clock = new[1]
                elif action.kind in SEND or action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    if action.kind not in SEND:
                        received[(action.kind, action.stage, action.microbatch)] = step
                    posted = {}
                    index = by_step[(rank, step)]
                    sender, send_step, receiver, recv_step, previous = transfers[index]
                    posted["send"] = _clock_before(programs[sender], send_step, end, sender)
                    posted["recv"] = _clock_before(programs[receiver], recv_step, end, receiver)
                    begin = max(posted.values())
                    if previous >= 0:
                        begin = max(begin, end[(transfers[previous][2], transfers[previous][3])])
                    size = costs.stages[_boundary(action)].output_bytes
                    new = (begin, begin + costs.link(sender, receiver).transfer_us(size))
                else:
                    begin = max(clock, collective)
                    duration = (
                        0.0 if action.kind is ActionKind.RESHARD else costs.duration_us(action.stage, action.kind)
                    )
                    new = (begin, begin + duration)
                    collective = new[1]
                    if action.kind is ActionKind.UNSHARD:
                        unshard[action.stage] = step
                if (start[key], end[key]) != new:
                    start[key], end[key] = new
                    changed = True
        if not changed:
            return {key: (start[key], end[key]) for key in start}
    raise AssertionError("no fixed point: the plan deadlocks")


def _duration(action: Action, costs: CostModel) -> float:
    if action.kind is ActionKind.OVERLAP_F_B:
        forward, backward = action.sub_actions
        return costs.overlap_us(forward.stage, backward.stage, backward.kind)
    return costs.duration_us(action.stage, action.kind)


def _boundary(action: Action) -> int:
    """The stage whose output (or its gradient) moves."""
    if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
        return action.stage
    return action.stage - 1


def _clock_before(program: list[Action], step: int, end: dict[tuple[int, int], float], rank: int) -> float:
    for index in range(step - 1, -1, -1):
        if program[index].kind in COMPUTE:
            return end[(rank, index)]
    return 0.0
