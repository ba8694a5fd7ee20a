"""The schedule generators: structure, closed forms (shared/facts.md), and torch's own orders."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from octopipe.ir import Action, ActionKind, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import verify_plan
from octopipe.tune import gpipe, interleaved_1f1b, one_f_one_b, zb_h1

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


# --- interleaved 1F1B and ZB-H1 ---

INTERLEAVED_GRID = [(p, v, m) for p, v, m in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 6, 8, 12])]


def computations(plan: plan_pb2.Plan) -> dict[int, list[str]]:
    return {r: [str(a) for a in acts if a.kind.is_compute] for r, acts in rank_actions(plan).items()}


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED_GRID)
def test_interleaved_runs_every_chunk_once_and_verifies(p: int, v: int, m: int) -> None:
    rounds = max(1, m // p)
    if m % rounds:
        with pytest.raises(ValueError, match="must be a multiple of"):
            interleaved_1f1b(p, v, m)
        return
    plan = interleaved_1f1b(p, v, m)
    assert len(plan.stages) == p * v
    assert [s.rank for s in plan.stages] == [s % p for s in range(p * v)]
    for rank, acts in computations(plan).items():
        stages = range(rank, p * v, p)
        assert sorted(acts) == sorted(f"{s}{k}{mb}" for s in stages for k in "FB" for mb in range(m))
    verify_plan(plan)  # every input exists before it is used, sends and receives pair up, no deadlock


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1_splits_every_backward_and_verifies(p: int, m: int) -> None:
    plan = zb_h1(p, m)
    for rank, acts in computations(plan).items():
        assert sorted(acts) == sorted(f"{rank}{k}{mb}" for k in "FIW" for mb in range(m))
        for mb in range(m):  # F, then I, then W
            assert acts.index(f"{rank}F{mb}") < acts.index(f"{rank}I{mb}") < acts.index(f"{rank}W{mb}")
    verify_plan(plan)


def test_zb_h1_order_on_four_ranks() -> None:
    compute = {r: " ".join(acts) for r, acts in computations(zb_h1(4, 6)).items()}
    assert compute[0] == "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5"
    # the last rank defers p-1 = 3 weight gradients, then catches up at the end
    assert compute[3] == "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5"


def torch_orders(schedule_class: Any, p: int, v: int, m: int) -> dict[int, list[str]]:
    """torch's own compute order, from its schedule classes with stand-in stages (no process group)."""
    orders = {}
    for rank in range(p):
        stages = [TorchStage(rank + c * p, p * v, rank, p) for c in range(v)]
        schedule = schedule_class(stages, m)
        orders[rank] = [str(a) for a in schedule.pipeline_order[rank] if a is not None]
    return orders


class TorchStage:
    """Just what torch's schedule classes read from a stage to compute their order."""

    def __init__(self, index: int, num_stages: int, rank: int, size: int) -> None:
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, size
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.is_first, self.is_last = index == 0, index == num_stages - 1


@pytest.mark.parametrize(
    ("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9), (4, 4, 16), (4, 2, 6), (2, 1, 8)]
)
def test_interleaved_matches_torch(p: int, v: int, m: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    assert computations(interleaved_1f1b(p, v, m)) == torch_orders(schedules.ScheduleInterleaved1F1B, p, v, m)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (4, 3), (8, 16)])
def test_zb_h1_matches_torch_zb1p(p: int, m: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    assert computations(zb_h1(p, m)) == torch_orders(schedules.ScheduleInterleavedZeroBubble, p, 1, m)


def test_new_generators_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        interleaved_1f1b(2, 0, 4)
    with pytest.raises(ValueError, match="needs 4"):
        interleaved_1f1b(2, 2, 4, layer_names=[["a"], ["b"]])
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        zb_h1(0, 4)
    plan = interleaved_1f1b(2, 2, 2, layer_names=[["a"], ["b"], ["c"], ["d"]])
    assert [list(s.layer_names) for s in plan.stages] == [["a"], ["b"], ["c"], ["d"]]
    assert plan.name == "interleaved-1f1b-p2-v2-m2"
    assert plan.labels["schedule"] == "interleaved-1f1b"
