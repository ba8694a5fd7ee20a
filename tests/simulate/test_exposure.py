"""Exposed collective time: the collective stream's busy time not under compute, on hand-made and simulated timelines."""

from __future__ import annotations

import pytest

from octopipe.ir import with_collectives
from octopipe.simulate import CostModel, StageCost, exposed_collective_us, simulate
from octopipe.tune import CollectivePlacement, interleaved_1f1b


def test_hand_made_spans() -> None:
    spans = [
        ("collective", 0.0, 5.0),  # nothing computes: exposed
        ("compute", 5.0, 15.0),
        ("collective", 5.0, 10.0),  # under the compute: hidden
        ("collective", 12.0, 18.0),  # 3 of 6 after the compute ends
        ("recv", 0.0, 100.0),  # other streams do not count
        ("collective", 16.0, 17.0),  # inside the one before: counted once
    ]
    assert exposed_collective_us(spans) == 8.0
    assert exposed_collective_us([]) == 0.0
    with pytest.raises(ValueError, match="ends"):
        exposed_collective_us([("collective", 2.0, 1.0)])


def test_a_simulated_step_hides_the_next_stages_gather_and_the_first_reduce() -> None:
    """pp=1 x dp=2, two stages on the rank, UNSHARDs prefetched: U0 0-5 exposed, U1 5-10 under 0F0 (5-15), 1REDUCE_GRAD
    45-52 under 0B0 (45-65), 0REDUCE_GRAD 65-72 exposed: 5 + 7."""
    plan = interleaved_1f1b(1, 2, 1)
    plan.mesh.dp = 2
    plan = with_collectives(plan, CollectivePlacement(prefetch=True))
    stage = StageCost(forward_us=10.0, full_backward_us=20.0, unshard_us=5.0, reduce_grad_us=7.0)
    simulation = simulate(plan, CostModel(stages=(stage, stage)))
    timeline = simulation.timeline(0)
    assert [t.action for t in timeline] == [
        "0UNSHARD", "1UNSHARD", "0F0", "1F0", "1B0", "1REDUCE_GRAD", "0B0", "0REDUCE_GRAD"
    ]  # fmt: skip
    assert exposed_collective_us((t.stream, t.start_us, t.end_us) for t in timeline) == 12.0
    assert simulation.estimate.step_time_us == 72.0
