"""torch.distributed.pipelining interop: torch's schedules import as verified Plans, and Plans export to torch's CSV."""

from __future__ import annotations

import pytest

from octopipe.execute.runtime.interop import torch_placement, torch_schedule_plan, torch_schedules
from octopipe.ir import Action, PlanError, plan_from_torch_csv, plan_to_torch_csv, rank_actions, stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import simulate, uniform_profile, verify_plan
from octopipe.tune import DEFAULT_SCHEDULES

TORCH_SCHEDULES = torch_schedules()  # class -> stages per rank, from the schedule registry
WORKING = [name for name in TORCH_SCHEDULES if name != "Schedule1F1B"]


@pytest.mark.parametrize("name", WORKING)
@pytest.mark.parametrize(("ranks", "m"), [(2, 4), (4, 8)])
def test_torch_schedules_import_verify_and_simulate(name: str, ranks: int, m: int) -> None:
    per_rank = TORCH_SCHEDULES[name]
    names = [[f"layers.{s}"] for s in range(ranks * per_rank)]
    plan = torch_schedule_plan(name, num_ranks=ranks, num_microbatches=m, layer_names=names)
    assert stage_ranks(plan) == torch_placement(name, ranks)
    estimate = simulate(plan, uniform_profile(plan)).estimate
    assert estimate.step_time_us > 0
    computations = [
        p for acts in rank_actions(plan).values() for a in acts if a.kind.is_compute for p in a.computations
    ]
    forwards = {(p.stage, p.microbatch) for p in computations if p.kind.name == "FORWARD"}
    assert forwards == {(s, mb) for s in range(ranks * per_rank) for mb in range(m)}
    again = plan_from_torch_csv(plan_to_torch_csv(plan), num_microbatches=m)
    # the export adds what torch's runtime needs to scale the gradients: one REDUCE_GRAD per stage
    reduced = [a for acts in rank_actions(again).values() for a in acts if a.kind.name == "REDUCE_GRAD"]
    assert sorted(a.stage for a in reduced) == list(range(ranks * per_rank))

    def kept(source: plan_pb2.Plan) -> dict[int, list[Action]]:
        return {r: [a for a in acts if a.kind.name != "REDUCE_GRAD"] for r, acts in rank_actions(source).items()}

    assert kept(again) == kept(plan)
    verify_plan(again)


def test_placement_of_v_and_interleaved_schedules() -> None:
    assert torch_placement("ScheduleZBVZeroBubble", 2) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert torch_placement("ScheduleInterleaved1F1B", 2) == {0: 0, 1: 1, 2: 0, 3: 1}


def test_torch_1f1b_order_is_refused_with_the_reason() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order is off by one on the last rank (shared/facts.md)
    with pytest.raises(PlanError, match="micro-batch 4 is out of range"):
        torch_schedule_plan("Schedule1F1B", num_ranks=2, num_microbatches=4)


def test_unknown_schedule_and_wrong_layer_count() -> None:
    with pytest.raises(ValueError, match="unknown torch schedule 'ScheduleMagic'"):
        torch_schedule_plan("ScheduleMagic", num_ranks=2, num_microbatches=4)
    with pytest.raises(ValueError, match="has 4 stages; layer_names has 2"):
        torch_schedule_plan("ScheduleZBVZeroBubble", num_ranks=2, num_microbatches=4, layer_names=[["a"], ["b"]])


def test_the_registry_names_torch_classes_that_exist_and_places_stages_as_torch_does() -> None:
    from torch.distributed.pipelining import schedules

    assert set(TORCH_SCHEDULES) == set(DEFAULT_SCHEDULES.torch_classes)
    for entry in DEFAULT_SCHEDULES:
        if entry.torch_class is None:
            continue
        assert hasattr(schedules, entry.torch_class), entry.torch_class
        for ranks in (2, 3):
            assert torch_placement(entry.torch_class, ranks) == dict(enumerate(entry.placement.stage_ranks(ranks)))


@pytest.mark.parametrize(
    "name", [e.name for e in DEFAULT_SCHEDULES.tunable if e.torch_class not in (None, "Schedule1F1B")]
)
@pytest.mark.parametrize(("ranks", "m"), [(2, 4), (4, 8)])
def test_registry_generators_order_their_actions_as_their_torch_class(name: str, ranks: int, m: int) -> None:
    entry = DEFAULT_SCHEDULES.entry(name)
    assert entry.torch_class is not None
    ours, theirs = entry.generate(ranks, m), torch_schedule_plan(entry.torch_class, num_ranks=ranks, num_microbatches=m)

    def compute(plan: plan_pb2.Plan) -> dict[int, list[str]]:
        return {r: [str(a) for a in acts if a.kind.is_compute] for r, acts in rank_actions(plan).items()}

    assert compute(ours) == compute(theirs)
