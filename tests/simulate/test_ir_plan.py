"""Whole plans: validation, the text form, torch CSV and files — all lossless."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hypothesis import given, settings

from octopipe.ir import (
    PlanError,
    Recompute,
    StageSpec,
    add_p2p_actions,
    build_plan,
    format_grid,
    load_plan,
    parse_action,
    plan_from_text,
    plan_from_torch_csv,
    plan_to_text,
    plan_to_torch_csv,
    rank_actions,
    save_plan,
    stage_ranks,
    validate_plan,
    with_recompute,
)
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import verify_plan
from tests.simulate.strategies import plans


def two_stage_plan() -> plan_pb2.Plan:
    return build_plan(
        stages=[StageSpec(rank=0, layer_names=("embed", "l0")), StageSpec(rank=1, layer_names=("l1", "head"))],
        actions={
            0: "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0RECV_B1 0I1 0W0 0W1 0REDUCE_GRAD".split(),
            1: "1RECV_F0 1F0 1RECV_F1 (1F1;1B0)OVERLAP_F_B 1SEND_B0 1B1 1SEND_B1".split(),
        },
        num_microbatches=2,
        name="two-stage",
        version=7,
        memory_caps={0: 1 << 30},
        labels={"schedule": "hand-written"},
    )


@settings(max_examples=150)
@given(plans())
def test_text_round_trip_is_lossless(plan: plan_pb2.Plan) -> None:
    validate_plan(plan)
    text = plan_to_text(plan)
    again = plan_from_text(text)
    assert again == plan
    assert plan_to_text(again) == text
    for program in again.ranks:  # presence of optional fields survives too
        original = plan.ranks[program.rank]
        assert program.HasField("memory_cap_bytes") == original.HasField("memory_cap_bytes")
    assert again.HasField("model") == plan.HasField("model")


@settings(max_examples=50)
@given(plans())
def test_binary_and_json_files_round_trip(plan: plan_pb2.Plan) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("p.binpb", "p.json", "p.txt"):
            path = Path(tmp) / name
            save_plan(plan, path)
            assert load_plan(path) == plan


def test_text_form_reads_as_documented() -> None:
    text = plan_to_text(two_stage_plan())
    assert text.splitlines()[:5] == [
        "octopipe-plan v1",
        'name "two-stage"',
        "version 7",
        "microbatches 2",
        'label "schedule" "hand-written"',
    ]
    assert 'stage 1 rank 1 ["l1", "head"]' in text
    assert "rank 0 cap 1073741824: 0UNSHARD 0F0 0SEND_F0" in text
    assert "rank 1: 1RECV_F0 1F0 1RECV_F1 (1F1;1B0)OVERLAP_F_B" in text


def test_torch_csv_export_refuses_a_plan_that_recomputes() -> None:
    """torch's CSV holds only action orders: a plan whose stages recompute is refused, not silently changed."""
    plan = with_recompute(two_stage_plan(), {1: Recompute(policy="budget", activation_budget=0.5)})
    with pytest.raises(PlanError, match=r"stages \[1\] recompute \(budget:0.5\): torch's CSV holds action orders"):
        plan_to_torch_csv(plan)
    assert plan_to_torch_csv(with_recompute(plan, {1: Recompute()})) == plan_to_torch_csv(two_stage_plan())


def test_torch_csv_round_trip_keeps_actions_and_placement() -> None:
    plan = two_stage_plan()
    again = plan_from_torch_csv(plan_to_torch_csv(plan), num_microbatches=2)
    assert rank_actions(again) == rank_actions(plan)
    assert stage_ranks(again) == stage_ranks(plan)
    compute = plan_from_torch_csv(plan_to_torch_csv(plan, format="compute_only"))
    # a compute-only file gets its communication on import, as torch's runtime lowers one when it loads it
    assert [str(a) for a in rank_actions(compute)[1] if a.kind.is_compute] == ["1F0", "(1F1;1B0)OVERLAP_F_B", "1B1"]
    assert [str(a) for a in rank_actions(compute)[1] if a.kind.is_p2p] == [
        "1RECV_F0",
        "1RECV_F1",
        "1SEND_B0",
        "1SEND_B1",
    ]
    verify_plan(compute)


def test_reads_torch_csv_with_idle_steps(tmp_path: Path) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = {
        0: [schedules._Action.from_str(s) for s in ("0F0", "0F1")] + [None, None] + [schedules._Action.from_str("0B0")],
        1: [None] + [schedules._Action.from_str(s) for s in ("1F0", "1B0", "1F1", "1B1")],
    }
    path = tmp_path / "torch.csv"
    with path.open("w", newline="") as f:  # exactly what torch's _dump_csv writes
        writer = csv.writer(f)
        for rank in order:
            writer.writerow(order[rank])
    plan = load_plan(path)
    assert [str(a) for a in rank_actions(plan)[0] if a.kind.is_compute] == ["0F0", "0F1", "0B0"]
    assert plan.num_microbatches == 2
    assert plan.name == "torch"
    for cell in plan_to_torch_csv(plan).replace("\n", ",").split(","):
        if cell:
            assert str(schedules._Action.from_str(cell)) == cell


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: setattr(p, "num_microbatches", 0), "at least 1 micro-batch"),
        (lambda p: p.ClearField("stages"), "no stages"),
        (lambda p: setattr(p.stages[1], "rank", 5), "stage 1 is placed on rank 5, but the plan has 2 rank programs"),
        (lambda p: setattr(p.ranks[1], "rank", 0), "ranks[1] says rank 0"),
        (lambda p: setattr(p.stages[0], "stage_index", 3), "stages[0] says stage 3"),
        (lambda p: p.stages[1].layer_names.append("l0"), "layer 'l0' is in stage 0 and stage 1"),
        (
            lambda p: setattr(p.ranks[0].actions[1], "microbatch_index", 2),
            "rank 0, step 1 (0F2): micro-batch 2 is out of range",
        ),
        (
            lambda p: setattr(p.ranks[0].actions[1], "stage_index", 1),
            "rank 0, step 1 (1F0): stage 1 is placed on rank 1",
        ),
        (lambda p: setattr(p.ranks[0].actions[1], "stage_index", 9), "stage 9 does not exist"),
        (lambda p: p.ranks[0].actions[0].ClearField("kind"), "rank 0, step 0: action kind 0 is not a valid ActionKind"),
        (
            lambda p: setattr(p.ranks[0].actions[0], "microbatch_index", 0),
            "rank 0, step 0: UNSHARD acts on the whole stage",
        ),
    ],
)
def test_validation_names_the_problem(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    plan = two_stage_plan()
    validate_plan(plan)
    mutate(plan)
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "first line must be 'octopipe-plan v1'"),
        ("octopipe-plan v1\nname 3\n", "line 2: 'name 3': expected a JSON string"),
        ("octopipe-plan v1\nbogus 1\n", "line 2: 'bogus 1': expected one of"),
        ("octopipe-plan v1\nmicrobatches 1\nstage 0 rank 0 []\nrank 0: 0F0 0Q1\n", "line 4"),
        ("octopipe-plan v1\nmicrobatches 1\nstage 0 rank 0 [1]\n", "layer names must be a JSON list of strings"),
    ],
)
def test_bad_text_names_the_line(text: str, message: str) -> None:
    with pytest.raises(PlanError) as info:
        plan_from_text(text)
    assert message in str(info.value)


def test_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    garbage = tmp_path / "plan.binpb"
    garbage.write_bytes(b"\xff\xff\xff")
    with pytest.raises(PlanError, match="not a valid binary plan"):
        load_plan(garbage)
    with pytest.raises(PlanError, match="cannot read the plan file"):
        load_plan(tmp_path / "missing.json")
    with pytest.raises(PlanError, match=r"unknown plan file suffix '\.yaml'"):
        load_plan(tmp_path / "plan.yaml")
    empty_csv = tmp_path / "plan.csv"
    empty_csv.write_text("\n")
    with pytest.raises(PlanError, match="the CSV has no actions"):
        load_plan(empty_csv)
    split = tmp_path / "split.csv"
    split.write_text("0F0\n0B0\n")
    with pytest.raises(PlanError, match="stage 0 has actions on ranks 0 and 1"):
        load_plan(split)


def test_lowering_adds_p2p_only_between_ranks() -> None:
    compute = {
        r: [parse_action(t) for t in texts.split()] for r, texts in {0: "0F0 3F0 3B0 0B0", 1: "1F0 2F0 2B0 1B0"}.items()
    }
    placement = {0: 0, 1: 1, 2: 1, 3: 0}  # a V: stages 0 and 3 on rank 0
    lowered = add_p2p_actions(compute, placement)
    # sends right after their producers; each channel's first receive at the start, the next one right after
    # the computation that consumes the previous one (one message ahead), in the sender's order
    assert [str(a) for a in lowered[0]] == "3RECV_F0 0F0 0SEND_F0 3F0 0RECV_B0 3B0 3SEND_B0 0B0".split()
    assert [str(a) for a in lowered[1]] == "1RECV_F0 1F0 2RECV_B0 2F0 2SEND_F0 2B0 1B0 1SEND_B0".split()
    assert add_p2p_actions(lowered, placement) == lowered


def test_grid_focus_marks_the_cell() -> None:
    grid = format_grid(two_stage_plan(), focus=(1, 3), context=1)
    lines = grid.splitlines()
    assert lines[0].split() == ["rank", "2", "3", "4"]
    assert ">(1F1;1B0)OVERLAP_F_B<" in lines[2]
