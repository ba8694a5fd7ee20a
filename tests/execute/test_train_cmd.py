"""``octopipe train``: a TOML config checked key by key, a job that trains as the Python API does, and the
embedded default that shows the loss falling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octopipe.execute.cli import EXIT_USAGE, main
from octopipe.execute.runtime import reference_run, workload_reference
from octopipe.execute.train_config import load_train_config


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[modle]\nworkload = 'llama-8'\n", "[modle] is not a section: use [model], [data]"),
        ("[model]\nlayers = 4\n", "[model] layers is not a key: use one of workload, tiny"),
        ("[run]\nsteps = 'many'\n", "[run] steps must be int, got str 'many'"),
        ("[run]\nsteps = true\n", "[run] steps must be int, got bool True"),
        ("[optimizer]\nbetas = [0.9]\n", "[optimizer] betas must be two numbers"),
        ("[optimizer]\nname = 'lion'\n", "optimizer must be one of adamw, sgd, got 'lion'"),
        ("[schedule]\nkind = 'cosine'\ntotal_steps = 5\nwarmup_steps = 5\n", "make total_steps larger"),
        ("[run\nsteps = 3\n", "not TOML"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    config = tmp_path / "train.toml"
    config.write_text(text)
    with pytest.raises(ValueError, match=None) as caught:
        load_train_config(config)
    assert says in str(caught.value), str(caught.value)
    assert main(["train", str(config)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_every_key_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for section, key in (("model", "workload"), ("data", "files"), ("optimizer", "clip_grad_norm"), ("run", "steps")):
        assert f"[{section}]" in out and f"    {key} (" in out


@pytest.mark.slow
def test_a_config_trains_as_the_python_api_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"{k * 7919 % 1000:03d} octopipe trains what the user wrote\n" for k in range(400)))
    config = tmp_path / "train.toml"
    config.write_text(
        "[model]\nworkload = 'llama-8'\nsequence = 16\nglobal_batch = 4\n"
        f"[data]\nfiles = ['{text}']\nseed = 2\n"
        "[optimizer]\nname = 'sgd'\nmomentum = 0.9\nlearning_rate = 0.05\n"
        "[schedule]\nwarmup_steps = 1\nkind = 'linear'\n"
        "[plan]\nschedule = '1f1b'\nmicrobatches = 2\n"
    )
    out = tmp_path / "out"
    assert main(["train", str(config), "--steps", "3", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and summary["steps"] == 3
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(4 * 16 / (r["step_ms"] / 1e3)) for r in rows)
    loaded = load_train_config(config)
    model = loaded.section("model")
    reference = workload_reference("llama-8", tiny=True, vocab=256, sequence=16, global_batch=4)
    assert model["vocab"] == 256 and model["tiny"]  # the defaults the file left out
    ref = reference_run(reference, num_microbatches=2, steps=3, optimization=loaded.optimization(3), data=loaded.data())
    assert [r["loss"] for r in rows] == ref.losses  # the same job as the Python API's, bitwise
    assert [r["grad_norm"] for r in rows] == ref.grad_norms  # clipped at the default 1.0 on every stage
    # warm-up over step 0, then linear from the peak (step 1) towards 10% of it (the default floor) at step 3
    assert [r["learning_rate"] for r in rows] == pytest.approx([0.05, 0.05, 0.05 * (0.1 + 0.9 * 0.5)])


@pytest.mark.slow
@pytest.mark.extended  # 200 steps on 2 ranks (about a minute here): with ./scripts/test.sh --all
def test_the_embedded_default_shows_the_loss_falling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 200
    # measured 5.44 -> 1.93; the margin: the last loss at most 60% of the first (bytes of Python source)
    assert summary["last_loss"] < 0.6 * summary["first_loss"], summary
