"""The IR's list-to-list passes: backward merge (against torch's own ``_merge_bw``) and FSDP placement."""

from __future__ import annotations

import pytest

from octopipe.ir import (
    ActionKind,
    CollectivePlacement,
    StageSpec,
    add_p2p_actions,
    build_plan,
    compile_plan,
    merge_backward,
    parse_action,
    rank_actions,
    stage_ranks,
    with_collectives,
)
from octopipe.simulate import verify_plan
from octopipe.tune import zb_h1, zb_v

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


@pytest.mark.parametrize("make", [zb_h1, zb_v], ids=["zb-h1", "zb-v"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_merge_backward_fuses_what_torch_fuses_and_still_verifies(make: object, p: int, m: int) -> None:
    plan = make(p, m)  # type: ignore[operator]
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in rank_actions(plan).items()}
    merged = merge_backward(compute)
    for rank, actions in compute.items():
        theirs = schedules._merge_bw([schedules._Action.from_str(str(a)) for a in actions])
        assert [str(a) for a in merged[rank]] == [str(a) for a in theirs]
    assert merge_backward(merged) == merged  # idempotent
    fused = sum(a.kind is ActionKind.FULL_BACKWARD for acts in merged.values() for a in acts)
    assert fused > 0
    placement = stage_ranks(plan)
    lowered = build_plan(
        stages=[StageSpec(rank=placement[s]) for s in range(len(plan.stages))],
        actions=add_p2p_actions(merged, placement),
        num_microbatches=m,
    )
    verify_plan(lowered)


def test_merge_backward_keeps_communication_in_between_after_the_fused_backward() -> None:
    program = {0: [parse_action(a) for a in "1RECV_B0 1F0 1I0 1SEND_B0 1W0 1I1 1F1 1W1".split()]}
    assert [str(a) for a in merge_backward(program)[0]] == "1RECV_B0 1F0 1B0 1SEND_B0 1I1 1F1 1W1".split()


def test_with_collectives_is_one_pass_for_the_tuner_and_the_runtime() -> None:
    plan = zb_h1(2, 4)
    plan.mesh.dp = 2
    for policy in (
        CollectivePlacement(),
        CollectivePlacement(reshard=True),
        CollectivePlacement(prefetch=False),
        CollectivePlacement(prefetch=False, ahead=2, reshard=True),
    ):
        placed = with_collectives(plan, policy)
        compile_plan(placed)
        assert with_collectives(placed, policy) == placed
        texts = [str(a) for a in rank_actions(placed)[1]]
        assert texts.count("1UNSHARD") == 1 and texts.count("1REDUCE_GRAD") == 1
        assert ("1RESHARD" in texts) == policy.reshard
    with pytest.raises(ValueError, match="ahead must be >= 0"):
        CollectivePlacement(prefetch=False, ahead=-1)
