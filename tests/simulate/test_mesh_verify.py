"""The verifier's mesh and collective rules, and the mesh in the text form."""

from __future__ import annotations

import pytest

from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import (
    ActionCountError,
    MissingInputError,
    PlanError,
    StageSpec,
    VerificationError,
    build_plan,
    plan_from_text,
    plan_to_text,
    validate_plan,
    verify_plan,
)

# 1F1B on two ranks, two micro-batches, with FSDP collectives around each stage's computations.
RANK0 = "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD"
RANK1 = "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD"


def fsdp_plan(rank0: str = RANK0, rank1: str = RANK1, *, dp: int = 4, ep: int = 1) -> plan_pb2.Plan:
    plan = build_plan(
        stages=[StageSpec(rank=0, layer_names=("a",)), StageSpec(rank=1, layer_names=("b",))],
        actions={0: rank0.split(), 1: rank1.split()},
        num_microbatches=2,
    )
    plan.mesh.dp, plan.mesh.ep = dp, ep
    return plan


def test_fsdp_plan_verifies_and_round_trips_as_text() -> None:
    plan = fsdp_plan(dp=4, ep=2)
    verify_plan(plan)
    text = plan_to_text(plan)
    assert "mesh dp 4 ep 2\n" in text
    assert plan_from_text(text) == plan
    plan.mesh.global_ranks.extend([0, 2, 4, 6, 1, 3, 5, 7])
    text = plan_to_text(plan)
    assert "mesh dp 4 ep 2 ranks [0, 2, 4, 6, 1, 3, 5, 7]\n" in text
    assert plan_from_text(text) == plan


def test_mesh_presence_survives_the_text_form() -> None:
    plan = fsdp_plan(dp=0, ep=0)  # present but all defaults: still written, still present after
    plan.mesh.SetInParent()
    again = plan_from_text(plan_to_text(plan))
    assert again.HasField("mesh") and again == plan
    plan.ClearField("mesh")
    assert "mesh" not in plan_to_text(plan)
    assert not plan_from_text(plan_to_text(plan)).HasField("mesh")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("mesh dp 4 ep 3", "does not divide"),
        ("mesh dp 2 ep 1 ranks [0, 1, 2]", "needs 4"),
        ("mesh dp two", "mesh dp D"),
    ],
)
def test_bad_mesh_text_is_refused(line: str, message: str) -> None:
    text = plan_to_text(fsdp_plan()).replace("mesh dp 4 ep 1", line)
    with pytest.raises(PlanError, match=message):
        plan_from_text(text)


def test_validate_plan_checks_the_mesh() -> None:
    plan = fsdp_plan(dp=2)
    plan.mesh.global_ranks.extend([0, 1, 2, 2])
    with pytest.raises(PlanError, match="permutation"):
        validate_plan(plan)
    with pytest.raises(PlanError, match="permutation"):
        verify_plan(plan)


@pytest.mark.parametrize(
    ("rank0", "rank1", "error", "where", "says"),
    [
        (
            RANK0.replace(" 0REDUCE_GRAD", ""),
            RANK1,
            ActionCountError,
            (0, 10, ""),
            "add 0REDUCE_GRAD to rank 0 after the stage's last backward",
        ),
        (
            RANK0.replace("0B1 0REDUCE_GRAD", "0REDUCE_GRAD 0B1"),
            RANK1,
            VerificationError,
            (0, 9, "0B1"),
            "move REDUCE_GRAD after its last backward",
        ),
        (
            RANK0,
            RANK1.replace("1UNSHARD 1RECV_F0 1F0", "1RECV_F0 1F0 1UNSHARD"),
            MissingInputError,
            (1, 1, "1F0"),
            "put 1UNSHARD before it",
        ),
        (
            RANK0.replace("0F1 0SEND_F1", "0F1 0SEND_F1 0RESHARD"),
            RANK1,
            MissingInputError,
            (0, 7, "0B0"),
            "stage 0's unsharded parameters",
        ),
        (
            RANK0.replace("0UNSHARD 0F0", "0UNSHARD 0UNSHARD 0F0"),
            RANK1,
            VerificationError,
            (0, 1, "0UNSHARD"),
            "already unsharded",
        ),
        (
            RANK0.replace("0UNSHARD 0F0", "0RESHARD 0UNSHARD 0F0"),
            RANK1,
            VerificationError,
            (0, 0, "0RESHARD"),
            "not unsharded here",
        ),
        (
            RANK0.replace("0REDUCE_GRAD", "0REDUCE_GRAD 0REDUCE_GRAD"),
            RANK1,
            VerificationError,
            (0, 10, "0REDUCE_GRAD"),
            "already reduced",
        ),
    ],
    ids=[
        "no-reduce-grad",
        "reduce-before-last-backward",
        "unshard-late",
        "reshard-too-early",
        "unshard-twice",
        "reshard-first",
        "reduce-twice",
    ],
)
def test_broken_collectives_are_rejected_where_they_break(
    rank0: str, rank1: str, error: type[VerificationError], where: tuple[int, int, str], says: str
) -> None:
    with pytest.raises(error) as caught:
        verify_plan(fsdp_plan(rank0, rank1))
    assert (caught.value.rank, caught.value.step, caught.value.action) == where, str(caught.value)
    assert says in str(caught.value)


def test_reduce_grad_is_optional_without_data_parallelism() -> None:
    rank0, rank1 = RANK0.replace(" 0REDUCE_GRAD", ""), RANK1.replace(" 1REDUCE_GRAD", "")
    verify_plan(fsdp_plan(rank0, rank1, dp=1))
    plan = fsdp_plan(rank0, rank1)
    plan.ClearField("mesh")
    verify_plan(plan)


def test_data_parallel_stages_must_be_unsharded() -> None:
    """With dp > 1 the runtime shards every stage (FSDP), so a stage computing without its UNSHARD is refused."""
    rank0 = RANK0.replace("0UNSHARD ", "").replace(" 0RESHARD", "")
    with pytest.raises(MissingInputError, match="put 0UNSHARD before it"):
        verify_plan(fsdp_plan(rank0, RANK1))
    verify_plan(fsdp_plan(rank0, RANK1, dp=1))  # without data parallelism UNSHARD is optional
