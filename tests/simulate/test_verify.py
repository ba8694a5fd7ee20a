"""The static verifier: every deliberately broken plan is rejected, naming the right rank, step and action."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import (
    ActionCountError,
    CostModel,
    DeadlockError,
    MemoryCapError,
    MissingInputError,
    PlanError,
    SimulationConfig,
    StageCost,
    StageSpec,
    VerificationError,
    build_plan,
    simulate,
    verify_plan,
)
from octopipe.tune import gpipe, interleaved_1f1b, one_f_one_b, zb_h1

# 1F1B on two ranks, three micro-batches, as the generator lowers it.
RANK0 = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"
RANK1 = "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"


def two_ranks(rank0: str = RANK0, rank1: str = RANK1, *, caps: dict[int, int] | None = None) -> plan_pb2.Plan:
    return build_plan(
        stages=[StageSpec(rank=0, layer_names=("a",)), StageSpec(rank=1, layer_names=("b",))],
        actions={0: rank0.split(), 1: rank1.split()},
        num_microbatches=3,
        memory_caps=caps,
    )


def v_shape(rank0: str, rank1: str) -> plan_pb2.Plan:
    """Stages 0 and 3 on rank 0, 1 and 2 on rank 1; one micro-batch."""
    return build_plan(
        stages=[StageSpec(rank=0), StageSpec(rank=1), StageSpec(rank=1), StageSpec(rank=0)],
        actions={0: rank0.split(), 1: rank1.split()},
        num_microbatches=1,
    )


@dataclass(frozen=True)
class Broken:
    name: str
    plan: plan_pb2.Plan
    error: type[VerificationError]
    rank: int
    step: int
    action: str
    says: str


CASES = [
    Broken(
        "circular wait: rank 0 sends F1 only after its B0, which needs rank 1 to get past F1",
        two_ranks(
            "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0SEND_F1 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2",
            "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2",
        ),
        DeadlockError,
        0,
        4,
        "0B0",
        "circular wait between ranks 0 -> 1 -> 0",
    ),
    Broken(
        "unmatched receive: rank 0 never sends F1",
        two_ranks(RANK0.replace(" 0SEND_F1", "")),
        DeadlockError,
        1,
        4,
        "1RECV_F1",
        "never comes",
    ),
    Broken(
        "receives posted in the wrong order",
        two_ranks(rank1="1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"),
        DeadlockError,
        1,
        0,
        "1RECV_F1",
        "matched in order",
    ),
    Broken(
        "sends in the wrong order",
        two_ranks("0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"),
        DeadlockError,
        1,
        0,
        "1RECV_F0",
        "meets 0SEND_F1 (rank 0, step 2)",
    ),
    Broken(
        "input never received",
        two_ranks(rank1=RANK1.replace("1RECV_F2 ", "")),
        MissingInputError,
        1,
        8,
        "1F2",
        "add 1RECV_F2 before this step",
    ),
    Broken(
        "output gradient never received",
        two_ranks(RANK0.replace("0RECV_B1 ", "")),
        MissingInputError,
        0,
        8,
        "0B1",
        "add 0RECV_B1",
    ),
    Broken(
        "backward before its forward",
        two_ranks(rank1=RANK1.replace("1F0 1B0", "1B0 1F0")),
        MissingInputError,
        1,
        1,
        "1B0",
        "the forward 1F0",
    ),
    Broken(
        "send before the data exists",
        two_ranks(RANK0.replace("0F0 0SEND_F0", "0SEND_F0 0F0")),
        MissingInputError,
        0,
        0,
        "0SEND_F0",
        "send after the forward",
    ),
    Broken(
        "W without its I",
        build_plan(stages=[StageSpec(rank=0)], actions={0: "0F0 0W0 0I0".split()}, num_microbatches=1),
        MissingInputError,
        0,
        1,
        "0W0",
        "0I0",
    ),
    Broken(
        "an overlapped unit whose backward needs its own forward",
        build_plan(stages=[StageSpec(rank=0)], actions={0: ["(0F0;0B0)OVERLAP_F_B"]}, num_microbatches=1),
        MissingInputError,
        0,
        0,
        "(0F0;0B0)OVERLAP_F_B",
        "the forward 0F0",
    ),
    Broken(
        "compute on sharded parameters",
        build_plan(stages=[StageSpec(rank=0)], actions={0: "0F0 0UNSHARD 0B0 0RESHARD".split()}, num_microbatches=1),
        MissingInputError,
        0,
        0,
        "0F0",
        "put 0UNSHARD before it",
    ),
    Broken(
        "gradients reduced before the last backward",
        two_ranks(RANK0.replace("0RECV_B2 0B2", "0REDUCE_GRAD 0RECV_B2 0B2")),
        VerificationError,
        0,
        12,
        "0B2",
        "move REDUCE_GRAD after",
    ),
    Broken(
        "a send between stages on the same rank",
        v_shape(
            "0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 0RECV_B0 0B0",
            "1RECV_F0 1F0 1SEND_F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0",
        ),
        VerificationError,
        1,
        2,
        "1SEND_F0",
        "same-rank stages hand over without communication",
    ),
    Broken(
        "a micro-batch without its backward",
        two_ranks(RANK0.replace(" 0RECV_B2 0B2", ""), RANK1),
        ActionCountError,
        0,
        10,
        "",
        "stage 0 micro-batch 2 has no backward",
    ),
    Broken(
        "a micro-batch without its forward",
        two_ranks(
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        ),
        ActionCountError,
        0,
        8,
        "",
        "stage 0 micro-batch 2 has no forward",
    ),
    Broken(
        "I without W",
        build_plan(stages=[StageSpec(rank=0)], actions={0: "0F0 0I0".split()}, num_microbatches=1),
        ActionCountError,
        0,
        2,
        "",
        "has I but no W",
    ),
    Broken(
        "a duplicated forward",
        two_ranks(RANK0.replace("0F2 0SEND_F2", "0F2 0SEND_F2 0F1")),
        ActionCountError,
        0,
        8,
        "0F1",
        "already ran at step 2",
    ),
    Broken(
        "a full backward and an input backward for one micro-batch",
        build_plan(stages=[StageSpec(rank=0)], actions={0: "0F0 0B0 0I0 0W0".split()}, num_microbatches=1),
        ActionCountError,
        0,
        2,
        "0I0",
        "B, or I and W",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_broken_plan_is_rejected_where_it_breaks(case: Broken) -> None:
    with pytest.raises(case.error) as caught:
        verify_plan(case.plan)
    error = caught.value
    assert isinstance(error, PlanError)
    assert (error.rank, error.step, error.action) == (case.rank, case.step, case.action), str(error)
    assert case.says in str(error)
    message = str(error)
    assert message.startswith(f"rank {case.rank}, step {case.step}")
    assert error.grid in message  # the rank x step grid around the cell
    if case.action:
        assert f">{case.action}<" in error.grid
    # simulate rejects it the same way
    with pytest.raises(case.error):
        simulate(case.plan, CostModel.uniform(num_stages=len(case.plan.stages), stage=StageCost()))


def test_memory_cap_exceeded_names_rank_time_and_excess() -> None:
    """Rank 0 of 1F1B holds two micro-batches (20 bytes) at the start of 0F1 (t=1): over a 15-byte cap by 5."""
    plan = two_ranks(caps={0: 15, 1: 15})
    costs = CostModel.uniform(num_stages=2, stage=StageCost(forward_us=1, backward_input_us=1, activation_bytes=10))
    with pytest.raises(MemoryCapError) as caught:
        verify_plan(plan, costs)
    error = caught.value
    assert (error.rank, error.step, error.action) == (0, 2, "0F1")
    assert (error.cap_bytes, error.peak_bytes, error.excess_bytes, error.time_us) == (15, 20, 5, 1.0)
    assert "5 bytes over" in str(error) and ">0F1<" in str(error)
    # Without enforcement the estimate reports it instead.
    estimate = simulate(plan, costs, config=SimulationConfig(enforce_memory_caps=False)).estimate
    assert not estimate.fits
    assert [r.fits for r in estimate.ranks] == [False, True]
    verify_plan(two_ranks(caps={0: 20, 1: 10}), costs)  # exactly at the cap fits


def test_static_bytes_over_the_cap_fail_at_time_zero() -> None:
    plan = two_ranks(caps={1: 99})
    costs = CostModel.uniform(num_stages=2, stage=StageCost(parameter_bytes=100))
    with pytest.raises(MemoryCapError) as caught:
        verify_plan(plan, costs)
    assert (caught.value.rank, caught.value.time_us, caught.value.excess_bytes) == (1, 0.0, 1)


def test_three_rank_cycle_is_followed_around() -> None:
    """Rank 0 sends F1 after B0: 0 waits for 1, 1 for 2 (B0), 2 for 1 (F1 never reaches it)... reported as a cycle."""
    plan = build_plan(
        stages=[StageSpec(rank=r) for r in range(3)],
        actions={
            0: "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0SEND_F1 0RECV_B1 0B1".split(),
            1: "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1".split(),
            2: "2RECV_F0 2F0 2RECV_F1 2F1 2B0 2SEND_B0 2B1 2SEND_B1".split(),
        },
        num_microbatches=2,
    )
    with pytest.raises(DeadlockError, match="circular wait between ranks 0 -> 1 -> 0") as caught:
        verify_plan(plan)
    assert (caught.value.rank, caught.value.step, caught.value.action) == (0, 4, "0B0")


@pytest.mark.parametrize(
    "plan",
    [gpipe(3, 4), one_f_one_b(4, 8), interleaved_1f1b(2, 2, 4), interleaved_1f1b(4, 2, 8), zb_h1(4, 8), zb_h1(2, 1)],
    ids=["gpipe", "1f1b", "interleaved-p2", "interleaved-p4", "zb-h1", "zb-h1-m1"],
)
def test_generated_plans_verify(plan: plan_pb2.Plan) -> None:
    verify_plan(plan)


def test_verify_runs_structural_validation_first() -> None:
    plan = one_f_one_b(2, 2)
    plan.ranks[0].actions[0].stage_index = 1  # stage 1 is on rank 1
    with pytest.raises(PlanError, match="stage 1 is placed on rank 1"):
        verify_plan(plan)
    with pytest.raises(PlanError, match="stage 1 is placed on rank 1"):
        simulate(plan, CostModel.uniform(num_stages=2, stage=StageCost()))


def test_malformed_actions_are_reported_by_validate_plan() -> None:
    costs = CostModel.uniform(num_stages=2, stage=StageCost())
    for mutate, says in [
        (lambda p: setattr(p.ranks[0].actions[0], "kind", plan_pb2.ACTION_KIND_UNSPECIFIED), "not a valid ActionKind"),
        (lambda p: setattr(p.ranks[1].actions[1], "microbatch_index", 7), "micro-batch 7 is out of range"),
        (lambda p: setattr(p.ranks[1].actions[1], "stage_index", 9), "stage 9 does not exist"),
    ]:
        plan = one_f_one_b(2, 2)
        mutate(plan)
        with pytest.raises(PlanError, match=says):
            simulate(plan, costs)
