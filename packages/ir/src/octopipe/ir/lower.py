"""Lowering: add the point-to-point actions a compute-only schedule implies.

Every direction between two ranks is a channel that completes its messages in
issue order (NCCL on the channel's communicator, the runtime's strict-order
mode on gloo; see :mod:`octopipe.ir.program`). This pass places the actions so
that every channel's receives are posted in the order its sends are issued:

* a SEND goes right after the computation that produces it (so a channel's
  order is the sender's program order);
* a RECV is posted one message ahead: the first receive of each channel at the
  start of the program, and the next one right after the computation that
  consumes the previous one, so that the transfer runs while the rank computes;
  the data is waited for by the computation that uses it. A computation that
  needs a message the sender sends after others not yet posted posts those
  first, in the sender's order.

Neighbouring stages on the same rank hand over without communication, so
nothing is added between them. Existing communication actions are dropped
first, so lowering is idempotent. A compute order that cannot run (a circular
dependency, a missing producer) is still lowered; the verifier names what is
wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from octopipe.ir.actions import Action, ActionKind

__all__ = ["add_p2p_actions"]

_BACKWARDS = (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)


def _receives(part: Action, placement: Mapping[int, int], num_stages: int) -> tuple[Action, int] | None:
    """The receive a computation consumes from another rank, and that rank; None if it needs none."""
    s, mb = part.stage, part.microbatch
    if mb is None:  # UNSHARD, RESHARD, REDUCE_GRAD
        return None
    rank = placement[s]
    if part.kind is ActionKind.FORWARD and s > 0 and placement[s - 1] != rank:
        return Action(ActionKind.RECV_F, s, mb), placement[s - 1]
    if part.kind in _BACKWARDS and s + 1 < num_stages and placement[s + 1] != rank:
        return Action(ActionKind.RECV_B, s, mb), placement[s + 1]
    return None


def _sends(part: Action, placement: Mapping[int, int], num_stages: int) -> tuple[Action, int, Action] | None:
    """The send a computation produces for another rank, that rank and the receive it posts; or None."""
    s, mb = part.stage, part.microbatch
    if mb is None:
        return None
    rank = placement[s]
    if part.kind is ActionKind.FORWARD and s + 1 < num_stages and placement[s + 1] != rank:
        return Action(ActionKind.SEND_F, s, mb), placement[s + 1], Action(ActionKind.RECV_F, s + 1, mb)
    if part.kind in _BACKWARDS and s > 0 and placement[s - 1] != rank:
        return Action(ActionKind.SEND_B, s, mb), placement[s - 1], Action(ActionKind.RECV_B, s - 1, mb)
    return None


def add_p2p_actions(
    actions: Mapping[int, Sequence[Action]],
    placement: Mapping[int, int],
) -> dict[int, list[Action]]:
    """Each rank's actions with SEND_F / RECV_F / SEND_B / RECV_B added (see the module docstring)."""
    num_stages = max(placement) + 1 if placement else 0
    compute = {rank: [a for a in program if not a.kind.is_p2p] for rank, program in actions.items()}
    # (source, destination) -> the receives the destination must post, in the source's send order
    channels: dict[tuple[int, int], list[Action]] = {}
    for rank, program in compute.items():
        for action in program:
            for part in action.computations:
                found = _sends(part, placement, num_stages)
                if found is not None:
                    channels.setdefault((rank, found[1]), []).append(found[2])
    lowered: dict[int, list[Action]] = {}
    for rank, program in compute.items():
        incoming = {source: recvs for (source, destination), recvs in channels.items() if destination == rank}
        position = {recv: (source, index) for source, recvs in incoming.items() for index, recv in enumerate(recvs)}
        posted = dict.fromkeys(incoming, 0)
        out: list[Action] = []

        def post_through(
            source: int, index: int, *, out: list[Action] = out, posted: dict[int, int] = posted, rank: int = rank
        ) -> None:
            """Post the channel's receives up to and including ``index``, in the sender's order."""
            recvs = channels[(source, rank)]
            stop = min(index + 1, len(recvs))
            if stop > posted[source]:
                out.extend(recvs[posted[source] : stop])
                posted[source] = stop

        for source in sorted(incoming):
            post_through(source, 0)
        for action in program:
            consumed: list[int] = []
            for part in action.computations:
                needed = _receives(part, placement, num_stages)
                if needed is None:
                    continue
                recv = needed[0]
                if recv not in position:  # nobody sends it; the verifier names the gap
                    out.append(recv)
                    continue
                source, index = position[recv]
                post_through(source, index)
                consumed.append(source)
            out.append(action)
            for part in action.computations:
                found_send = _sends(part, placement, num_stages)
                if found_send is not None:
                    out.append(found_send[0])
            for source in consumed:  # one message ahead on the channel just used
                post_through(source, posted[source])
        lowered[rank] = out
    return lowered
