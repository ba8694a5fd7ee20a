"""``octopipe train``: a TOML config checked key by key, a job that trains as the Python API does, and the
embedded default that shows the loss falling."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from octopipe.execute.cli import EXIT_USAGE, main
from octopipe.execute.runtime import reference_run, workload_reference
from octopipe.execute.runtime.job import prepare_job
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.execute.train_config import load_train_config


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[modle]\nworkload = 'llama-8'\n", "[modle] is not a section: use [model], [weights]"),
        ("[model]\noptions = [1]\n", "[model] options must be a table of plain values"),
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
    # [run] compile defaults to auto: this test's compile index is cold, so both stages ran as captured (bitwise)
    assert summary["compile"] == "auto" and sorted(summary["stage_backends"]) == ["0", "1"]
    assert all("as captured (compile cache cold" in note for note in summary["stage_backends"].values())
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
    for row in rows:  # the figures a user watches, per step and per rank
        assert 0 < row["mfu"] < 1 and 0 <= row["bubble"] < 1
        assert set(row["peak_rss_mib"]) == {"0", "1"} and all(v > 0 for v in row["peak_rss_mib"].values())
        assert all(v > 0 for v in row["peak_held_mib"].values())
    scalars = _tensorboard_scalars(out / "tensorboard")
    assert scalars["loss"] == [(r["step"], struct.unpack("f", struct.pack("f", r["loss"]))[0]) for r in rows]
    assert {"mfu", "tokens_per_s", "peak_rss_mib/rank1", "bubble"} <= set(scalars)


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard event file, read record by record (length, crc, event, crc)."""
    from tensorboardX.proto import event_pb2  # type: ignore[import-untyped]

    (path,) = folder.glob("events.out.tfevents.*")
    data, at = path.read_bytes(), 0
    out: dict[str, list[tuple[int, float]]] = {}
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@pytest.mark.slow
@pytest.mark.extended  # the CLI's route to what test_pretrained's round trip checks by default (CI's budget)
def test_an_hf_folder_trains_from_its_weights_and_exports_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[model] hf`` names a transformers folder: its weights are loaded stage by stage (the default), the
    model's own random-token batches ([data] enabled = false), the export reloads with from_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "in")
    toml = tmp_path / "train.toml"
    text = (
        f"[model]\nhf = '{tmp_path / 'in'}'\nsequence = 8\nglobal_batch = 4\n[data]\nenabled = false\n"
        f"[weights]\nexport = '{tmp_path / 'out'}'\n[plan]\nschedule = '1f1b'\nmicrobatches = 2\n"
        "[schedule]\nwarmup_steps = 0\nkind = 'constant'\n"
    )
    toml.write_text(text)
    profile = tmp_path / "profile.binpb"  # the model's layers profiled, for the simulator's prediction
    reference = prepare_job(load_train_config(toml), 2)
    profile.write_bytes(profile_reference(reference.plan.model, num_microbatches=2, repeats=2).SerializeToString())
    toml.write_text(text + f"[metrics]\ntensorboard = false\nprofile = '{profile}'\n")
    assert main(["train", str(toml), "--steps", "2", "--out", str(tmp_path / "m"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tensorboard"] is None and summary["steps"] == 2
    assert summary["predicted_step_ms"] > 0 and 0 <= summary["predicted_bubble"] < 1
    loaded = load_train_config(toml)
    reference = prepare_job(loaded, 2)
    ref = reference_run(
        reference.plan.model,
        num_microbatches=2,
        steps=2,
        optimization=loaded.optimization(2),
        weights=reference.options.weights,
    )
    rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == ref.losses
    back = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    assert all(torch.equal(back[name], value) for name, value in ref.params.items())


@pytest.mark.slow
@pytest.mark.extended  # 200 steps on 2 ranks (about a minute here): extended (CI runs it; --quick leaves it out)
def test_the_embedded_default_shows_the_loss_falling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 200
    # measured 5.44 -> 1.93; the margin: the last loss at most 60% of the first (bytes of Python source)
    assert summary["last_loss"] < 0.6 * summary["first_loss"], summary


@pytest.mark.slow
@pytest.mark.extended  # a profile and a tuner's search before the run (about 25 s)
def test_a_tuned_plan_trains_as_the_single_process_and_predicts_its_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "train.toml"
    config.write_text(
        "[model]\nworkload = 'llama-8'\nsequence = 16\nglobal_batch = 4\n[data]\nmax_bytes = 40000\n"
        "[plan]\nschedule = 'tune'\nmicrobatches = 2\ntune_budget_s = 2.0\n[metrics]\ntensorboard = false\n"
    )
    assert main(["train", str(config), "--steps", "2", "--out", str(tmp_path / "out"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["predicted_step_ms"] > 0  # the tuner's profile predicts the steps it chose
    loaded = load_train_config(config)
    reference = workload_reference("llama-8", tiny=True, vocab=256, sequence=16, global_batch=4)
    ref = reference_run(reference, num_microbatches=2, steps=2, optimization=loaded.optimization(2), data=loaded.data())
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == ref.losses
    assert main(["train", str(config), "--torchrun"]) == EXIT_USAGE  # each rank would search on its own
    assert "every rank would search on its own" in capsys.readouterr().err
