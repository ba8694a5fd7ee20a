"""The runnable examples of docs/python-api.md: a plain nn.Module and a HuggingFace model, tuned and run on 2 ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("script", "layers"),
    [
        ("own_module.py", None),
        # 25 s; HF models as written run by default in test_whole_model_runtime and test_pretrained
        pytest.param(
            "own_hf_model.py",
            "layers: model.embed_tokens model.layers.0 model.layers.1 model.layers.2",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_example_runs_and_matches_eager(script: str, layers: str | None) -> None:
    if not (EXAMPLES / script).exists():
        pytest.skip("docs/examples is not in this sandbox")
    if script == "own_hf_model.py":
        pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, check=False, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("tuned: ") for line in lines), result.stdout
    assert "same losses as eager: True" in lines, result.stdout
    if layers:
        assert any(line.startswith(layers) for line in lines), result.stdout
