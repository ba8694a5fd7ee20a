"""GPipe and 1F1B against their closed forms (shared/facts.md)."""

from __future__ import annotations

import itertools

import pytest

from octopipe.simulate.ir import Action, ActionKind, rank_actions
from octopipe.tune import gpipe, one_f_one_b

GRID = [(p, m) for p, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16])]


def in_flight_peak(actions: list[Action], stage: int) -> int:
    """Most micro-batches whose forward ran and whose backward has not."""
    live = peak = 0
    for action in actions:
        if action.kind is ActionKind.FORWARD and action.stage == stage:
            live += 1
        elif action.kind is ActionKind.FULL_BACKWARD and action.stage == stage:
            live -= 1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_every_microbatch_once_and_comms_match(schedule, p: int, m: int) -> None:  # type: ignore[no-untyped-def]
    plan = schedule(p, m)
    programs = rank_actions(plan)
    for actions in programs.values():
        compute = [(a.kind, a.microbatch) for a in actions if a.kind.is_compute]
        assert sorted(compute, key=str) == sorted(
            [(ActionKind.FORWARD, mb) for mb in range(m)] + [(ActionKind.FULL_BACKWARD, mb) for mb in range(m)], key=str
        )
        for mb in range(m):  # forward before backward
            kinds = [a.kind for a in actions if a.microbatch == mb and a.kind.is_compute]
            assert kinds == [ActionKind.FORWARD, ActionKind.FULL_BACKWARD]
    sends = {
        (a.kind, a.stage, a.microbatch)
        for acts in programs.values()
        for a in acts
        if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
    }
    recvs = {
        (a.kind, a.stage, a.microbatch)
        for acts in programs.values()
        for a in acts
        if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
    }
    assert {(ActionKind.RECV_F, s + 1, mb) for (k, s, mb) in sends if k is ActionKind.SEND_F} == {
        r for r in recvs if r[0] is ActionKind.RECV_F
    }
    assert {(ActionKind.RECV_B, s - 1, mb) for (k, s, mb) in sends if k is ActionKind.SEND_B} == {
        r for r in recvs if r[0] is ActionKind.RECV_B
    }
    assert len(sends) == 2 * (p - 1) * m


@pytest.mark.parametrize(("p", "m"), GRID)
def test_1f1b_peak_activations_closed_form(p: int, m: int) -> None:
    programs = rank_actions(one_f_one_b(p, m))
    for rank in range(p):
        assert in_flight_peak(programs[rank], rank) == min(p - rank, m)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_peak_activations_closed_form(p: int, m: int) -> None:
    programs = rank_actions(gpipe(p, m))
    for rank in range(p):
        assert in_flight_peak(programs[rank], rank) == m


def test_1f1b_order_on_four_ranks() -> None:
    programs = rank_actions(one_f_one_b(4, 6))
    compute = {r: " ".join(str(a) for a in acts if a.kind.is_compute) for r, acts in programs.items()}
    assert compute[0] == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert compute[3] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_bad_arguments_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="one stage per rank"):
        one_f_one_b(2, 4, layer_names=[["a"]])
