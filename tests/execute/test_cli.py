"""The `octopipe` CLI: help, version, plan show/convert, demo, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from octopipe.execute.cli import EXIT_OK, EXIT_USAGE, main
from octopipe.simulate.ir import load_plan, plan_to_text
from octopipe.tune import one_f_one_b

# The console script where the package is installed (scripts/setup.sh); `python -m` where it is
# only on the path (Pants' test sandbox). Both run octopipe.execute.cli:entry.
_SCRIPT = Path(sys.executable).parent / "octopipe"
OCTOPIPE: list[str] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "octopipe.execute"]


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("octopipe-execute")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def test_console_script_help_and_version() -> None:
    result = subprocess.run([*OCTOPIPE, "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    for command in ("plan", "demo"):
        assert command in result.stdout
    version = subprocess.run([*OCTOPIPE, "--version"], capture_output=True, text=True, check=False)
    assert version.returncode == 0
    assert version.stdout.strip() == f"octopipe {installed_version()}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bogus"], "invalid choice: 'bogus'"),
        (["plan", "show"], "one of the arguments path --example is required"),
        (["plan", "show", "--example", "zb"], "invalid choice: 'zb'"),
        (["plan", "show", "--example", "1f1b", "--ranks", "0"], "num_ranks must be >= 1"),
        (["plan", "show", "/no/such/plan.binpb"], "cannot read the plan file"),
        (["plan", "show", "plan.yaml"], "unknown plan file suffix"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("octopipe: error: ")
    assert message in err[0]


def test_unreadable_plan_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "plan.txt"
    bad.write_text("octopipe-plan v1\nmicrobatches 2\nstage 0 rank 0 []\nrank 0: 0F7\n")
    assert main(["plan", "show", str(bad)]) == EXIT_USAGE
    assert "micro-batch 7 is out of range" in capsys.readouterr().err


def test_show_example_as_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "show", "--example", "1f1b", "--ranks", "2", "--microbatches", "3", "--compute-only"]) == EXIT_OK
    )
    grid = capsys.readouterr().out.splitlines()
    assert grid[1].split() == ["0", "0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert main(["plan", "show", "--example", "1f1b", "--as", "text"]) == EXIT_OK
    assert capsys.readouterr().out == plan_to_text(one_f_one_b(2, 4))
    assert main(["plan", "show", "--example", "gpipe", "--as", "json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["name"] == "gpipe-p2-m4"
    assert main(["plan", "show", "--example", "1f1b", "--as", "csv", "--compute-only"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[0] == "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3"


def test_convert_between_formats(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text(plan_to_text(one_f_one_b(3, 5)))
    assert main(["plan", "convert", str(text), str(tmp_path / "p.binpb")]) == EXIT_OK
    assert main(["plan", "convert", str(tmp_path / "p.binpb"), str(tmp_path / "p.json")]) == EXIT_OK
    assert load_plan(tmp_path / "p.json") == one_f_one_b(3, 5)
    assert main(["plan", "convert", str(tmp_path / "p.json"), str(tmp_path / "p.csv")]) == EXIT_OK
    assert (tmp_path / "p.csv").read_text().splitlines()[2].startswith("2RECV_F0,2F0,2B0,2SEND_B0")


def test_demo_writes_round_tripping_plans(tmp_path: Path) -> None:
    result = subprocess.run(
        [*OCTOPIPE, "--log-format", "json", "demo", "--out", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "plan 1f1b-p2-m4: 2 stages on 2 ranks, 4 micro-batches" in result.stdout
    plans = [load_plan(tmp_path / name) for name in ("plan.binpb", "plan.json", "plan.txt")]
    assert plans[0] == plans[1] == plans[2]
    assert list(plans[0].stages[0].layer_names)[:2] == ["embed", "layers.0"]
    event = json.loads(result.stderr.strip().splitlines()[-1])
    assert event["event"] == "demo_plan_written"
    assert event["ranks"] == 2


def test_profile_writes_a_profile(tmp_path: Path) -> None:
    from octopipe.profile.v1 import profile_pb2

    out = tmp_path / "profile.binpb"
    result = subprocess.run(
        [
            *OCTOPIPE,
            "profile",
            "--workload",
            "nemotronh-16",
            "--tiny",
            "--sequence",
            "8",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    profile = profile_pb2.Profile.FromString(out.read_bytes())
    assert profile.model.name == "nemotronh-16"
    assert [c.layer_type for c in profile.layers][:4] == ["embedding", "mamba2", "relu2", "mamba2"]
    assert "layers.5" in result.stdout and f"written: {out}" in result.stdout
    bad = subprocess.run(
        [*OCTOPIPE, "profile", "--out", str(tmp_path / "p.yaml")], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"octopipe: error: --out {tmp_path / 'p.yaml'}: use a .binpb, .pb or .json file"
