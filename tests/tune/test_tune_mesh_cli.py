"""``octopipe tune --devices``: choose pp x dp x m with FSDP collectives; a plan and predicted metrics out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from octopipe.execute.cli import EXIT_OK, EXIT_USAGE, main
from octopipe.execute.cli.tune import parse_bytes
from octopipe.simulate import load_plan, verify_plan
from tests.tune.test_mesh_tune import mesh_profile


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json_format.MessageToJson(mesh_profile(10, seed=4)))
    return path


def test_tune_devices_writes_a_mesh_plan_and_json(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mesh.binpb"
    argv = ["tune", str(profile_path), "--devices", "8", "--global-batch", "32", "--memory-cap", "1MB"]
    argv += ["--p2p-bandwidth", "1GB/s", "--out", str(out)]
    assert main([*argv, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    verify_plan(plan)
    assert load_plan(tmp_path / "mesh.txt") == plan
    assert report["pp"] * report["dp"] == 8
    assert report["microbatches"] * report["microbatch_size"] * report["dp"] == 32
    assert plan.mesh.dp == report["dp"] and len(plan.ranks) == report["pp"]
    assert report["tuned"]["fits"] and max(report["tuned"]["peak_memory_bytes"]) <= 10**6
    assert report["tuned"]["step_time_us"] <= report["baseline_1f1b_same_mesh"]["step_time_us"]
    assert {c["pp"] for c in report["candidates"]} == {1, 2, 4, 8}
    assert main(argv) == EXIT_OK  # tables
    printed = capsys.readouterr().out
    assert "chosen: pp" in printed and "speedup over 1F1B on the same mesh" in printed


def test_collective_bandwidth_flag_overrides_the_profile(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["tune", str(profile_path), "--devices", "4", "--global-batch", "16", "--memory-cap", "1MB"]
    base += ["--p2p-bandwidth", "1GB/s", "--pipeline-degrees", "2", "--out", str(tmp_path / "p.binpb"), "--json"]
    assert main(base) == EXIT_OK
    slow = json.loads(capsys.readouterr().out)["tuned"]["step_time_us"]
    assert main([*base, "--collective-bandwidth", "1TB/s", "--collective-latency-us", "0"]) == EXIT_OK
    fast = json.loads(capsys.readouterr().out)["tuned"]["step_time_us"]
    assert fast < slow


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "8", "--memory-cap", "1MB"], "--global-batch"),
        (["--devices", "8", "--global-batch", "32", "--memory-cap", "80XB"], "not a size"),
        (["--devices", "8", "--global-batch", "32", "--memory-cap", "1MB", "--ranks", "2"], "drop --ranks"),
        (["--devices", "8", "--global-batch", "32", "--memory-cap", "1MB"], "--p2p-bandwidth"),
        (
            ["--devices", "8", "--global-batch", "32", "--memory-cap", "1KB", "--p2p-bandwidth", "1GB/s"],
            "raise the cap",
        ),
        (["--memory-cap", "1MB"], "give --ranks and --microbatches"),
        (["--devices", "8", "--global-batch", "32", "--memory-cap", "1MB", "--tp", "two"], "--tp 'two'"),
        (["--devices", "8", "--global-batch", "32", "--memory-cap", "1MB", "--cp", "0"], "positive integers"),
    ],
)
def test_bad_mesh_input_exits_2_with_one_line(
    profile_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", str(profile_path), *args]) == EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("50GB/s", 50 * 10**9), ("1.5MiB", 3 * 2**19)],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_tune_devices_searches_tensor_and_context_degrees(
    profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mesh.binpb"
    argv = ["tune", str(profile_path), "--devices", "8", "--global-batch", "32", "--memory-cap", "1MB"]
    argv += ["--p2p-bandwidth", "1GB/s", "--tp", "1,2", "--cp", "1,2", "--sequence-parallel", "--out", str(out)]
    assert main([*argv, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    plan = load_plan(out)
    verify_plan(plan)
    assert report["pp"] * report["dp"] * report["tp"] * report["cp"] == 8
    assert (plan.mesh.tp or 1, plan.mesh.cp or 1) == (report["tp"], report["cp"])
    assert plan.mesh.sequence_parallel == (report["tp"] > 1) == report["sequence_parallel"]
    assert {(c["tp"], c["cp"]) for c in report["candidates"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
