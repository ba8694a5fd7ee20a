"""`octopipe run`: a plan file in, losses and step times out, a side-by-side trace and measured timelines written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from octopipe.execute.runtime import build_model, workload_reference
from octopipe.ir import save_plan
from octopipe.profile.v1 import profile_pb2
from octopipe.transform import COMPILED_TOLERANCE
from octopipe.tune import one_f_one_b
from tests.execute.test_cli import OCTOPIPE

pytestmark = pytest.mark.slow


@pytest.mark.extended  # 21 s; the README's run command (test_demo) profiles, simulates, runs and traces by default
def test_run_profile_simulate_and_trace(tmp_path: Path) -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=8)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(2, 4, layer_names=[names[:5], names[5:]])
    plan.model.CopyFrom(reference)
    save_plan(plan, tmp_path / "plan.txt")
    profile = tmp_path / "profile.binpb"
    made = subprocess.run(
        [*OCTOPIPE, "profile", "--workload", "llama-8", "--tiny", "--sequence", "8", "--microbatch-size", "2",
         "--repeats", "1", "--out", str(profile)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = subprocess.run(
        [*OCTOPIPE, "run", str(tmp_path / "plan.txt"), "--steps", "2", "--profile", str(profile),
         "--trace", str(tmp_path / "trace.json"), "--timeline", str(tmp_path / "timeline.binpb"), "--no-pin"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured step ms" in result.stdout and "simulated step ms" in result.stdout
    trace = json.loads((tmp_path / "trace.json").read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"simulated rank 0", "simulated rank 1", "measured rank 0", "measured rank 1"} <= processes
    measured = [e for e in trace["traceEvents"] if e.get("ph") == "X" and str(e.get("cat", "")).startswith("measured")]
    assert {e["name"] for e in measured} >= {"0F0", "1B3", "0SEND_F0", "1RECV_F3"}
    timelines = profile_pb2.Profile.FromString((tmp_path / "timeline.binpb").read_bytes()).timelines
    assert sorted((t.rank, t.step) for t in timelines) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.end_us >= r.start_us >= 0 for t in timelines for r in t.records)
    assert all(t.peak_memory_bytes > 0 for t in timelines)


def test_run_refuses_a_plan_without_a_model(tmp_path: Path) -> None:
    save_plan(one_f_one_b(2, 2), tmp_path / "plan.txt")
    result = subprocess.run([*OCTOPIPE, "run", str(tmp_path / "plan.txt")], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "the plan names no model" in result.stderr


def _tiny_plan(tmp_path: Path) -> Path:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=8)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(2, 4, layer_names=[names[:5], names[5:]])
    plan.model.CopyFrom(reference)
    save_plan(plan, tmp_path / "plan.txt")
    return tmp_path / "plan.txt"


def test_the_compile_default_says_what_ran_and_eager_opts_out(tmp_path: Path) -> None:
    """`--compile auto` is the default: with this test's cold compile index every stage runs as captured, and one
    line says so and how to change it; `--compile eager` opts out and says that."""
    plan = _tiny_plan(tmp_path)
    auto = subprocess.run([*OCTOPIPE, "run", str(plan), "--steps", "1", "--no-pin"], capture_output=True, text=True)
    assert auto.returncode == 0, auto.stderr[-3000:]
    line = next(x for x in auto.stdout.splitlines() if x.startswith("stage graphs"))
    assert line.startswith("stage graphs (--compile auto): stage 0: as captured (compile cache cold: 4 of 4 graphs")
    assert "stage 1: as captured (compile cache cold" in line and "--compile eager runs them as captured" in line
    assert "--compile inductor compiles every graph once and fills the cache" in line
    eager = subprocess.run(
        [*OCTOPIPE, "run", str(plan), "--steps", "1", "--no-pin", "--compile", "eager", "--json"],
        capture_output=True,
        text=True,
    )
    assert eager.returncode == 0, eager.stderr[-3000:]
    report = json.loads(eager.stdout)
    assert report["compile"] == "eager" and report["stage_backends"] == {}


@pytest.mark.extended  # compiles the tiny model's stages with Inductor (minutes on a cold cache)
def test_after_a_compiled_run_auto_finds_the_cache_warm(tmp_path: Path) -> None:
    plan = _tiny_plan(tmp_path)
    command = [*OCTOPIPE, "run", str(plan), "--steps", "1", "--no-pin", "--json"]
    eager = subprocess.run([*command, "--compile", "eager"], capture_output=True, text=True)
    compiled = subprocess.run([*command, "--compile", "inductor"], capture_output=True, text=True)
    auto = subprocess.run(command, capture_output=True, text=True)
    for done in (eager, compiled, auto):
        assert done.returncode == 0, done.stderr[-3000:]
    notes = json.loads(auto.stdout)["stage_backends"]
    assert sorted(notes) == ["0", "1"]
    for stage, note in notes.items():  # which graphs run compiled is what this machine measured; none is unseen
        assert note.startswith(f"stage {stage}: compiled ") and "cache cold" not in note, note
    first, *others = [json.loads(done.stdout)["losses"] for done in (eager, compiled, auto)]
    atol, rtol = COMPILED_TOLERANCE[torch.float32]  # compiled graphs agree with eager to rounding
    for losses in others:
        assert all(abs(a - b) <= atol + rtol * abs(b) for a, b in zip(losses, first, strict=True))
