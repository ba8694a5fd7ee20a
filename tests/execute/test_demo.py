"""The README's run command, end to end: profile, tune, verify, simulate, run, and what it prints and writes.

It runs ``./scripts/run.sh`` itself where the checkout has been set up (``.venv``
made by ``scripts/setup.sh``, as in CI), else ``python -m octopipe.execute demo``
(Pants' sandbox), with ``--out`` in a temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from octopipe.ir import load_plan, validate_plan

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "scripts" / "run.sh"
IN_VENV = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
pytestmark = pytest.mark.slow  # two launches of rank processes: 25 s on an idle 2-core machine, 90 s contended

SPEEDUP = re.compile(r"speed-up over 1F1B with equal layer counts: (\d+\.\d+)x measured \(predicted (\d+\.\d+)x")


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (the demo's children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_readme_run_command(tmp_path: Path) -> None:
    readme = ROOT / "README.md"
    assert not readme.exists() or "./scripts/run.sh" in readme.read_text()
    out = tmp_path / "demo"
    command = [str(RUN_SH)] if RUN_SH.exists() and IN_VENV else [sys.executable, "-m", "octopipe.execute", "demo"]
    marker = f"OCTOPIPE_DEMO_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "COLUMNS": "160"}
    result = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, check=False, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert not _processes_with(marker), "the demo left processes behind"

    # printed: the plan, predicted vs measured, the speed-up
    stdout = result.stdout
    assert "plan: " in stdout and "stage" in stdout and "rank" in stdout
    assert "step ms predicted" in stdout and "step ms measured" in stdout and "1F1B equal" in stdout
    summary = json.loads((out / "summary.json").read_text())
    speedup = summary["speedup_over_1f1b_equal"]
    assert summary["choice"] and f"chosen: {summary['choice'][:40]}" in " ".join(stdout.split())
    if summary["ran_1f1b_only"]:  # the fastest plan was not predicted faster by more than the 5% error
        assert summary["fastest_predicted_speedup"] <= 1 + summary["min_gain"]
        assert "no plan beats 1F1B by more than the simulator's 5% error" in " ".join(stdout.split())
        assert speedup == {"measured": 1.0, "predicted": 1.0}
    else:
        match = SPEEDUP.search(" ".join(stdout.split()))
        assert match, stdout[-3000:]
        assert f"{speedup['measured']:.2f}" == match.group(1)
        assert speedup["predicted"] > 1 + summary["min_gain"]
    tuned, baseline = summary["comparison"]["tuned"], summary["comparison"]["baseline_1f1b_equal"]
    assert speedup["measured"] == pytest.approx(baseline["measured_step_ms"] / tuned["measured_step_ms"])
    predicted = summary["predicted"]  # the tuner's own estimates: the demo predicts what `octopipe tune` does
    assert tuned["predicted_step_ms"] == pytest.approx(predicted["tuned"]["step_time_us"] / 1e3)
    assert baseline["predicted_step_ms"] == pytest.approx(predicted["baseline_1f1b_equal"]["step_time_us"] / 1e3)
    assert summary["losses_equal"], "the tuned plan and 1F1B must give the same losses (same model, same data)"
    # compiled stages are the default where the compile cache is warm; this test's is cold, and a line says so
    assert summary["compile"] == "auto" and summary["stage_backends"], summary["stage_backends"]
    assert all("as captured (compile cache cold" in note for note in summary["stage_backends"].values())
    assert "stage graphs (--compile auto): stage 0: as captured" in " ".join(stdout.split())
    assert all(m > 0 for m in tuned["measured_peak_activation_bytes"])

    # the trace: valid JSON, simulated and measured ranks side by side, each with its actions
    trace = json.loads((out / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"simulated rank 0", "simulated rank 1", "measured rank 0", "measured rank 1"} <= set(names.values())
    for prefix in ("simulated", "measured"):
        spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and names[e["pid"]].startswith(prefix)]
        assert {e["name"] for e in spans} >= {"0F0", "1F7"}, prefix
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = load_plan(out / "plan.binpb")
    validate_plan(plan)
    assert load_plan(out / "plan.txt") == plan
    assert len(plan.ranks) == 2 and plan.model.name == "nemotronh-16"
