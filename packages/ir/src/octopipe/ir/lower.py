"""Lowering: add the point-to-point actions a compute-only schedule implies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from octopipe.ir.actions import Action, ActionKind

__all__ = ["add_p2p_actions"]

_BACKWARDS = (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)


def add_p2p_actions(
    actions: Mapping[int, Sequence[Action]],
    placement: Mapping[int, int],
) -> dict[int, list[Action]]:
    """Insert RECV_F / SEND_F / RECV_B / SEND_B around each compute action.

    A send goes just after the computation that produces it. A receive goes
    just before the computation that needs it, except that the receives from
    one peer are posted in the order that peer sends (point-to-point messages
    between two ranks match in order, in NCCL and gloo alike): when a
    computation needs a receive that the peer sends after others not yet
    posted, those are posted first. Neighbouring stages on the same rank hand
    over without communication, so nothing is added between them. Existing
    communication actions are dropped first, so lowering is idempotent.
    """
    num_stages = max(placement) + 1 if placement else 0
    steps: dict[int, list[tuple[Action, list[Action], list[Action]]]] = {}
    # (source, destination) -> the receives the destination must post, in the source's send order.
    channels: dict[tuple[int, int], list[Action]] = {}
    for rank, program in actions.items():
        steps[rank] = []
        for action in program:
            if action.kind.is_p2p:
                continue
            before: list[Action] = []
            after: list[Action] = []
            for part in action.computations:
                s, mb = part.stage, part.microbatch
                if part.kind is ActionKind.FORWARD:
                    if s > 0 and placement[s - 1] != rank:
                        before.append(Action(ActionKind.RECV_F, s, mb))
                    if s + 1 < num_stages and placement[s + 1] != rank:
                        after.append(Action(ActionKind.SEND_F, s, mb))
                        channels.setdefault((rank, placement[s + 1]), []).append(Action(ActionKind.RECV_F, s + 1, mb))
                elif part.kind in _BACKWARDS:
                    if s + 1 < num_stages and placement[s + 1] != rank:
                        before.append(Action(ActionKind.RECV_B, s, mb))
                    if s > 0 and placement[s - 1] != rank:
                        after.append(Action(ActionKind.SEND_B, s, mb))
                        channels.setdefault((rank, placement[s - 1]), []).append(Action(ActionKind.RECV_B, s - 1, mb))
            steps[rank].append((action, before, after))
    lowered: dict[int, list[Action]] = {}
    for rank, program_steps in steps.items():
        incoming = {source: recvs for (source, destination), recvs in channels.items() if destination == rank}
        position = {recv: (source, index) for source, recvs in incoming.items() for index, recv in enumerate(recvs)}
        posted = dict.fromkeys(incoming, 0)
        out: list[Action] = []
        for action, before, after in program_steps:
            for recv in before:
                if recv not in position:  # nobody sends it; the verifier names the gap
                    out.append(recv)
                    continue
                source, index = position[recv]
                if index >= posted[source]:
                    out.extend(incoming[source][posted[source] : index + 1])
                    posted[source] = index + 1
            out.append(action)
            out.extend(after)
        lowered[rank] = out
    return lowered
