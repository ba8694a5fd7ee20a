"""``octopipe tune``: a Profile in, a plan (proto + text) and predicted metrics out; bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from octopipe.execute.cli import EXIT_OK, EXIT_USAGE, main
from octopipe.simulate import load_plan, verify_plan
from octopipe.tune import DEFAULT_SCHEDULES, Placement, ScheduleEntry
from tests.tune.test_registry import interleaved_3
from tests.tune.test_tune import heterogeneous


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json_format.MessageToJson(heterogeneous(12, seed=2)))
    return path


def test_tune_writes_plan_text_and_json_metrics(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tuned.binpb"
    argv = ["tune", str(profile_path), "--ranks", "3", "--microbatches", "6", "--kicks", "0", "--out", str(out)]
    assert main([*argv, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    verify_plan(plan)
    assert load_plan(tmp_path / "tuned.txt") == plan
    assert report["tuned"]["step_time_us"] <= report["baseline_1f1b_equal"]["step_time_us"]
    assert report["tuned"]["fits"] and report["phases"]
    assert max(report["tuned"]["peak_memory_bytes"]) <= report["memory_cap_bytes"][0]
    assert main(argv) == EXIT_OK  # tables and progress
    printed = capsys.readouterr().out
    assert "predicted step" in printed and "speedup over 1F1B" in printed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "40", "--microbatches", "4"], "use fewer ranks"),
        (["--ranks", "2", "--microbatches", "4", "--memory-cap", "1"], "no plan fits"),
        (["--ranks", "2", "--microbatches", "4", "--families", "ring"], "families"),
        (["--ranks", "2", "--microbatches", "4", "--out", "plan.csv"], "--out"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    profile_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", str(profile_path), *args]) == EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_unreadable_profile_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", str(tmp_path / "missing.binpb"), "--ranks", "2", "--microbatches", "2"]) == EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["tune", str(broken), "--ranks", "2", "--microbatches", "2"]) == EXIT_USAGE
    assert "not an octopipe.profile.v1.Profile" in capsys.readouterr().err


def test_tune_searches_the_registry_main_is_given(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A schedule on a new placement family, registered in a test: ``octopipe tune --families`` takes it."""
    entry = ScheduleEntry(
        name="interleaved-1f1b-3", placement=Placement.interleaved(3), generator=interleaved_3, split_backward=False
    )
    registry = DEFAULT_SCHEDULES.with_entry(entry)
    argv = ["tune", str(profile_path), "--ranks", "2", "--microbatches", "4", "--kicks", "0"]
    argv += ["--families", "interleaved-3", "--out", str(tmp_path / "tuned.binpb"), "--json"]
    assert main(argv, registry=registry) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert list(report["best_by_family_us"]) == ["interleaved-3"]
    assert main(argv) == EXIT_USAGE  # the default registry has no such family
    assert "families ['interleaved-3']: choose from linear" in capsys.readouterr().err
