"""The schedule registry: every entry generates a valid plan on its own placement; names are unique; the
registry is an immutable value; a schedule registered in a test is searched by the tuner."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from octopipe.ir import ActionKind, rank_actions, stage_ranks
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import verify_plan
from octopipe.tune import (
    DEFAULT_SCHEDULES,
    FAMILIES,
    MeshTuneConfig,
    Placement,
    ScheduleEntry,
    ScheduleRegistry,
    TuneConfig,
    interleaved_1f1b,
    one_f_one_b,
    placement_for,
    tune,
    tune_mesh,
    zb_h1,
)
from tests.tune.test_mesh_tune import mesh_profile
from tests.tune.test_tune import heterogeneous

GRID = list(itertools.product([1, 2, 3, 4], [1, 2, 4, 8]))
SPLIT = {ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}


def toy_zb() -> ScheduleEntry:
    """ZB-H1 registered under another name: what a newcomer's first entry looks like."""
    return ScheduleEntry(name="toy-zb", placement=Placement.linear(), generator=zb_h1, split_backward=True)


def interleaved_3(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    return interleaved_1f1b(num_ranks, 3, num_microbatches, layer_names=layer_names)


def kinds(plan: plan_pb2.Plan) -> set[ActionKind]:
    return {part.kind for actions in rank_actions(plan).values() for a in actions for part in a.computations}


@pytest.mark.parametrize("name", [entry.name for entry in DEFAULT_SCHEDULES.tunable])
def test_every_entry_generates_a_verified_plan_on_its_own_placement(name: str) -> None:
    entry = DEFAULT_SCHEDULES.entry(name)
    for p, m in GRID:
        stages = entry.placement.stages_per_rank * p
        layer_names = [[f"layers.{s}"] for s in range(stages)]
        try:
            plan = entry.generate(p, m, layer_names=layer_names)
        except ValueError as exc:  # where it does not apply it says what to change; m a multiple of 2p always does
            assert m % (2 * p) and ("num_microbatches" in str(exc) or "micro-batches" in str(exc)), (p, m, exc)
            continue
        verify_plan(plan)
        assert stage_ranks(plan) == dict(enumerate(entry.placement.stage_ranks(p)))
        assert [list(s.layer_names) for s in plan.stages] == layer_names
        assert plan.labels["schedule"] == entry.name
        if p > 1 and m > 1:  # one micro-batch on one rank can leave the split unused
            assert bool(kinds(plan) & SPLIT) == entry.split_backward, (p, m)


def test_names_and_torch_classes_are_unique_and_families_simplest_first() -> None:
    names = DEFAULT_SCHEDULES.names
    assert len(set(names)) == len(names)
    classes = DEFAULT_SCHEDULES.torch_classes
    assert len(set(classes)) == len(classes)
    assert FAMILIES == DEFAULT_SCHEDULES.families == ("linear", "interleaved-2", "interleaved-4", "v")
    for family in FAMILIES:
        placement = DEFAULT_SCHEDULES.placement(family)
        assert placement.label == family
        assert placement_for(family, 3) == placement.stage_ranks(3)
        assert all(e.placement == placement for e in DEFAULT_SCHEDULES.in_family(family))
    assert [e.name for e in DEFAULT_SCHEDULES.in_family("linear")] == ["gpipe", "1f1b", "zb-h1", "zb-h2"]


def test_placement_values() -> None:
    assert Placement.linear().stage_ranks(3) == (0, 1, 2)
    assert Placement.interleaved(2).stage_ranks(3) == (0, 1, 2, 0, 1, 2)
    assert Placement.v().stage_ranks(3) == (0, 1, 2, 2, 1, 0)
    assert Placement.interleaved(4).label == "interleaved-4" and Placement.v().label == "v"
    assert Placement.interleaved(3) == Placement("interleaved", 3)  # a value: equal when its fields are
    with pytest.raises(ValueError, match="chunks >= 2"):
        Placement.interleaved(1)
    with pytest.raises(ValueError, match="a v placement has 2"):
        Placement("v", 3)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        Placement.linear().stage_ranks(0)


def test_torch_only_entries_are_never_offered() -> None:
    only_torch = [e for e in DEFAULT_SCHEDULES if e.generator is None]
    assert {e.torch_class for e in only_torch} == {"ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"}
    for entry in only_torch:
        assert entry not in DEFAULT_SCHEDULES.tunable
        with pytest.raises(ValueError, match="torch interop only"):
            entry.generate(2, 4)


def test_with_entry_returns_a_new_registry_and_refuses_bad_entries() -> None:
    bigger = DEFAULT_SCHEDULES.with_entry(toy_zb())
    assert "toy-zb" in bigger and "toy-zb" not in DEFAULT_SCHEDULES  # the default is not changed
    assert len(bigger) == len(DEFAULT_SCHEDULES) + 1
    with pytest.raises(ValueError, match=r"\['toy-zb'\] are registered more than once"):
        bigger.with_entry(toy_zb())
    with pytest.raises(ValueError, match="torch classes"):
        DEFAULT_SCHEDULES.with_entry(
            ScheduleEntry(
                name="other",
                placement=Placement.linear(),
                generator=gpipe_like,
                split_backward=False,
                torch_class="ScheduleGPipe",
            )
        )
    with pytest.raises(ValueError, match="'list' is reserved"):
        ScheduleEntry(name="list", placement=Placement.linear(), generator=one_f_one_b, split_backward=False)
    with pytest.raises(ValueError, match="without spaces"):
        ScheduleEntry(name="my 1f1b", placement=Placement.linear(), generator=one_f_one_b, split_backward=False)
    with pytest.raises(ValueError, match="unknown schedule 'zb-h9': choose one of gpipe, 1f1b"):
        DEFAULT_SCHEDULES.entry("zb-h9")
    with pytest.raises(ValueError, match="unknown placement family 'ring': use one of linear"):
        DEFAULT_SCHEDULES.placement("ring")


def gpipe_like(
    num_ranks: int, num_microbatches: int, *, layer_names: Sequence[Sequence[str]] | None = None
) -> plan_pb2.Plan:
    return one_f_one_b(num_ranks, num_microbatches, layer_names=layer_names)


def test_a_renamed_schedule_keeps_its_order_under_its_new_name() -> None:
    plan = toy_zb().generate(3, 6)
    assert plan.name == "toy-zb-p3-m6" and plan.labels["schedule"] == "toy-zb"
    assert rank_actions(plan) == rank_actions(zb_h1(3, 6))


def test_the_tuner_searches_a_registered_schedule() -> None:
    """A registry of 1F1B and a renamed ZB-H1 (faster than 1F1B here): the tuner finds and names it."""
    registry = ScheduleRegistry((DEFAULT_SCHEDULES.entry("1f1b"), toy_zb()))
    profile = heterogeneous(12, seed=3)
    config = TuneConfig(
        num_ranks=3, num_microbatches=6, registry=registry, families=("linear",), list_scheduler=False, kicks=0
    )
    result = tune(profile, config)
    details = {phase.detail for phase in result.phases if phase.family == "linear"}
    assert "toy-zb" in details
    assert result.plan.labels["schedule"] == "toy-zb"
    assert result.description.startswith("toy-zb on linear placement")
    assert result.estimate.step_time_us < result.baseline.step_time_us


def test_a_schedule_on_a_new_placement_family_is_searched_as_a_family() -> None:
    entry = ScheduleEntry(
        name="interleaved-1f1b-3", placement=Placement.interleaved(3), generator=interleaved_3, split_backward=False
    )
    registry = DEFAULT_SCHEDULES.with_entry(entry)
    assert registry.families == ("linear", "interleaved-2", "interleaved-3", "interleaved-4", "v")
    profile = heterogeneous(12, seed=3)
    config = TuneConfig(
        num_ranks=2, num_microbatches=4, registry=registry, families=registry.families, list_scheduler=False, kicks=0
    )
    result = tune(profile, config)
    assert "interleaved-3" in result.best_by_family
    found = [p for p in result.phases if p.family == "interleaved-3" and p.phase == "schedule (initial partition)"]
    assert [p.detail for p in found] == ["interleaved-1f1b-3"]
    with pytest.raises(ValueError, match="families \\['interleaved-3'\\]: choose from linear"):
        TuneConfig(num_ranks=2, num_microbatches=4, families=("interleaved-3",))  # not in the default registry
    mesh = tune_mesh(
        mesh_profile(12, seed=1),
        MeshTuneConfig(
            devices=4, global_batch=8, memory_cap_bytes=10**9, registry=registry, families=("interleaved-3",)
        ),
    )
    searched = [c for c in mesh.candidates if c.pp in (1, 2)]  # pp = 4 has 12 stages: 1F1B is its best
    assert [c.placement for c in searched] == ["interleaved-3", "interleaved-3"]
    assert all(c.schedule.startswith("interleaved-1f1b-3 on interleaved-3 placement") for c in searched)


def test_the_tuner_needs_the_1f1b_baseline() -> None:
    with pytest.raises(ValueError, match="needs its '1f1b' entry"):
        TuneConfig(num_ranks=2, num_microbatches=4, registry=ScheduleRegistry((toy_zb(),)))
