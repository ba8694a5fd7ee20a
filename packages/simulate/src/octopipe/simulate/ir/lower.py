"""Lowering: add the point-to-point actions a compute-only schedule implies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from octopipe.simulate.ir.actions import Action, ActionKind

__all__ = ["add_p2p_actions"]

_BACKWARDS = (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT)


def add_p2p_actions(
    actions: Mapping[int, Sequence[Action]],
    placement: Mapping[int, int],
) -> dict[int, list[Action]]:
    """Insert RECV_F / SEND_F / RECV_B / SEND_B around each compute action.

    A receive goes just before the computation that needs it and a send just
    after the computation that produces it. Neighbouring stages on the same rank
    hand over without communication, so nothing is added between them. Existing
    communication actions are dropped first, so lowering is idempotent.
    """
    num_stages = max(placement) + 1 if placement else 0
    lowered: dict[int, list[Action]] = {}
    for rank, program in actions.items():
        out: list[Action] = []
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
                elif part.kind in _BACKWARDS:
                    if s + 1 < num_stages and placement[s + 1] != rank:
                        before.append(Action(ActionKind.RECV_B, s, mb))
                    if s > 0 and placement[s - 1] != rank:
                        after.append(Action(ActionKind.SEND_B, s, mb))
            out.extend(before)
            out.append(action)
            out.extend(after)
        lowered[rank] = out
    return lowered
