"""The `octopipe` CLI: help, version, plan show/convert, demo, one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from octopipe.execute.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from octopipe.execute.cli.main import HelpWithDefaults
from octopipe.ir import load_plan, plan_from_text, plan_to_text, rank_actions, stage_ranks
from octopipe.tune import DEFAULT_SCHEDULES, Placement, ScheduleEntry, one_f_one_b, zb_h1

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
    for command in ("profile", "tune", "simulate", "run", "trace", "coordinator", "node", "plan", "demo"):
        assert command in result.stdout
    version = subprocess.run([*OCTOPIPE, "--version"], capture_output=True, text=True, check=False)
    assert version.returncode == 0
    assert version.stdout.strip() == f"octopipe {installed_version()}"


def _commands(parser: argparse.ArgumentParser, name: str = "octopipe") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def test_every_option_of_every_command_has_help_that_shows_its_default() -> None:
    checked = 0
    for name, parser in _commands(build_parser()):
        shown = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            default = action.default
            if default in (None, False, "", [], ()) or not (action.option_strings or action.nargs == "?"):
                continue
            value = " ".join(map(str, default)) if isinstance(default, list) else str(default)
            said = HelpWithDefaults(name)._get_help_string(action) or ""
            assert "default" in said, f"{name} {action.option_strings}: the help does not give the default {value}"
            assert " ".join(said.replace("%(default)s", value).split()) in shown.replace("%%", "%")
            if "%(default)s" not in said:  # written by hand: it must say the default the parser has
                short = f"{default:g}" if isinstance(default, float) else value
                assert re.search(rf"default:? {re.escape(short)}\b", said), f"{name} {action.option_strings}: {said}"
            checked += 1
    assert checked > 40  # every command's defaulted options were seen, not an empty walk


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


def test_nccl_unsafe_plans_unknown_actions_and_wrong_microbatch_counts_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14's bad input: one line naming what to change (a verifier's grid may follow), exit 2, nothing runs."""
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1X1,1B1\n")
    assert main(["plan", "convert", str(unknown), str(tmp_path / "out.txt")]) == EXIT_USAGE
    first = capsys.readouterr().err.splitlines()[0]
    assert "CSV row 2 (rank 1), column 3: invalid action '1X1'" in first
    shifted = tmp_path / "shifted.csv"  # the last rank runs micro-batches 1..2, as torch's off-by-one 1F1B order
    shifted.write_text("0F0,0F1,0B0,0B1\n1F1,1B0,1F2,1B1\n")
    assert main(["plan", "convert", str(shifted), str(tmp_path / "out.txt"), "--microbatches", "2"]) == EXIT_USAGE
    first = capsys.readouterr().err.splitlines()[0]
    assert "stage 1 (rank 1) does not run micro-batches 0..1 (2 given)" in first and "--microbatches" in first
    assert not (tmp_path / "out.txt").exists()
    plan = one_f_one_b(2, 4, layer_names=[["embed", "layers.0"], ["layers.1", "head"]])
    texts = [str(a) for a in rank_actions(plan)[1]]
    actions = list(plan.ranks[1].actions)
    actions.insert(texts.index("1RECV_F0"), actions.pop(texts.index("1RECV_F1")))  # against the send order
    del plan.ranks[1].actions[:]
    plan.ranks[1].actions.extend(actions)
    unsafe = tmp_path / "unsafe.txt"
    unsafe.write_text(plan_to_text(plan))
    assert main(["simulate", str(unsafe)]) == EXIT_USAGE
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("octopipe: error: rank 1, step 0 (1RECV_F1): receives from rank 0 are matched in order")
    assert "post the receives from rank 0 in the order that rank sends" in first


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


@pytest.mark.parametrize("name", [entry.name for entry in DEFAULT_SCHEDULES.tunable])
def test_every_registry_schedule_is_an_example(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "show", "--example", name, "--as", "text"]) == EXIT_OK
    plan = plan_from_text(capsys.readouterr().out)
    assert plan.labels["schedule"] == name
    assert stage_ranks(plan) == dict(enumerate(DEFAULT_SCHEDULES.entry(name).placement.stage_ranks(2)))


def test_show_example_of_a_registered_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """A schedule registered in a test (ZB-H1 under a new name) is offered by ``plan show --example``."""
    toy = ScheduleEntry(name="toy-zb", placement=Placement.linear(), generator=zb_h1, split_backward=True)
    registry = DEFAULT_SCHEDULES.with_entry(toy)
    assert main(["plan", "show", "--example", "toy-zb", "--as", "text"], registry=registry) == EXIT_OK
    plan = plan_from_text(capsys.readouterr().out)
    assert plan.name == "toy-zb-p2-m4" and plan.labels["schedule"] == "toy-zb"
    assert rank_actions(plan) == rank_actions(zb_h1(2, 4))
    assert main(["plan", "show", "--example", "toy-zb"]) == EXIT_USAGE  # not in the default registry
    assert "invalid choice: 'toy-zb'" in capsys.readouterr().err


def test_convert_between_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "p.txt"
    text.write_text(plan_to_text(one_f_one_b(3, 5)))
    assert main(["plan", "convert", str(text), str(tmp_path / "p.binpb")]) == EXIT_OK
    assert main(["plan", "convert", str(tmp_path / "p.binpb"), str(tmp_path / "p.json")]) == EXIT_OK
    assert load_plan(tmp_path / "p.json") == one_f_one_b(3, 5)
    assert main(["plan", "convert", str(tmp_path / "p.json"), str(tmp_path / "p.csv")]) == EXIT_OK
    assert main(["plan", "convert", str(tmp_path / "p.json"), str(tmp_path / "q.txt"), "--json"]) == EXIT_OK
    written = json.loads(capsys.readouterr().out)
    assert written["format"] == "text" and written["ranks"] == 3 and written["stages"] == 3
    assert main(["plan", "show", str(tmp_path / "q.txt"), "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["num_microbatches"] == 5
    last_rank = (tmp_path / "p.csv").read_text().splitlines()[2]
    assert last_rank.startswith("2RECV_F0,2F0,2RECV_F1,2B0,2SEND_B0")  # the next receive posted one ahead
    assert last_rank.endswith("2B4,2REDUCE_GRAD,2SEND_B4")  # torch's runtime scales the gradients there


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recompute", "none"], "--recompute none: saving is always profiled"),
        (["--recompute", "budget:3"], "write budget:F with F a fraction in [0, 1]"),
        (["--recompute", "layers", "layers"], "a policy is listed twice"),
        (["--recompute", "layers", "--lockstep"], "--lockstep does not profile recomputation policies yet"),
    ],
)
def test_profile_refuses_bad_recompute_policies(tmp_path: Path, flags: list[str], message: str) -> None:
    result = subprocess.run(
        [*OCTOPIPE, "profile", "--tiny", *flags, "--out", str(tmp_path / "p.binpb")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "p.binpb").exists()


@pytest.mark.extended  # 15-20 s; test_run_cmd's default test profiles with the same command
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
            "--recompute",
            "layers",
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
    assert all([v.recompute for v in c.recomputed] == ["layers"] for c in profile.layers)
    inner = [c for c in profile.layers if c.layer_type == "mamba2"]
    assert all(c.recomputed[0].activation_saved_bytes < c.activation_saved_bytes for c in inner)
    assert [c.layer_type for c in profile.layers][:4] == ["embedding", "mamba2", "relu2", "mamba2"]
    assert "layers.5" in result.stdout and f"written: {out}" in result.stdout
    bad = subprocess.run(
        [*OCTOPIPE, "profile", "--out", str(tmp_path / "p.yaml")], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"octopipe: error: --out {tmp_path / 'p.yaml'}: use a .binpb, .pb or .json file"


def _plan_file(tmp_path: Path, *, named: bool = False) -> Path:
    path = tmp_path / "plan.txt"
    path.write_text(plan_to_text(one_f_one_b(2, 4, layer_names=[["a"], ["b"]] if named else None)))
    return path


def test_simulate_prints_the_estimate_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from octopipe.simulate import CostModel, StageCost, simulate

    plan = one_f_one_b(2, 4)  # names no layers: every stage's F, I and W cost 1 us
    expected = simulate(
        plan, CostModel.uniform(num_stages=2, stage=StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1))
    ).estimate
    assert expected.step_time_us == 15.0  # 1F1B: (m + p - 1) * (F + B), B = I + W, free links
    trace, png = tmp_path / "sim.json", tmp_path / "sim.png"
    argv = ["simulate", str(_plan_file(tmp_path)), "--json", "--trace", str(trace), "--png", str(png)]
    assert main(argv) == EXIT_OK
    document = json.loads(capsys.readouterr().out)
    assert document["plan"] == plan.name
    assert document["step_time_us"] == expected.step_time_us
    assert document["bubble_ratio"] == expected.bubble_ratio
    assert document["files"] == {"trace": str(trace), "png": str(png)}
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {"rank 0", "rank 1"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_rejected_plan_is_exit_2_with_the_error_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from octopipe.simulate import uniform_profile

    profile = uniform_profile(["a", "b"], num_ranks=2, activation_bytes=1000)
    (tmp_path / "costs.binpb").write_bytes(profile.SerializeToString())
    argv = [
        "simulate",
        str(_plan_file(tmp_path, named=True)),
        "--profile",
        str(tmp_path / "costs.binpb"),
        "--memory-cap",
        "1500",
    ]
    assert main(argv) == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("octopipe: error: rank ") and "memory cap of 1500 bytes" in lines[0]
    assert all(line.startswith("  ") for line in lines[1:]), "context after the error line is indented"


def test_trace_puts_measured_timelines_beside_the_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from octopipe.ir import action_to_proto, parse_action
    from octopipe.profile.v1 import profile_pb2
    from octopipe.simulate import uniform_profile

    (tmp_path / "costs.binpb").write_bytes(uniform_profile(["a", "b"], num_ranks=2).SerializeToString())
    measured = profile_pb2.Profile()
    for rank, actions in ((0, ["0F0", "0SEND_F0"]), (1, ["1RECV_F0", "1F0"])):
        for step in range(2):
            timeline = measured.timelines.add(rank=rank, step=step)
            for index, text in enumerate(actions):
                record = timeline.records.add(
                    stream="compute", start_us=10.0 * index, end_us=10.0 * index + 5, memory_after_bytes=64
                )
                record.action.CopyFrom(action_to_proto(parse_action(text)))
    (tmp_path / "timeline.binpb").write_bytes(measured.SerializeToString())
    out = tmp_path / "trace.json"
    argv = [
        "trace", str(_plan_file(tmp_path, named=True)), "--profile", str(tmp_path / "costs.binpb"),
        "--timeline", str(tmp_path / "timeline.binpb"), "--out", str(out), "--json",
    ]  # fmt: skip
    assert main(argv) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["tracks"] == ["simulated", "measured"]
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert set(names.values()) == {"simulated rank 0", "simulated rank 1", "measured rank 0", "measured rank 1"}
    spans = [(names[e["pid"]], e["name"], e["ts"], e["dur"]) for e in events if e.get("ph") == "X"]
    assert ("measured rank 1", "1F0", 10.0, 5.0) in spans
    assert ("simulated rank 0", "0F0", 0.0, 1.0) in [(*s[:3], round(s[3], 6)) for s in spans]
    assert main([*argv[:-1], "--step", "2"]) == EXIT_USAGE
    assert "--step 2: the measured steps are 0 to 1" in capsys.readouterr().err


def test_exit_codes_for_a_failed_run_and_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from octopipe.execute.cli import EXIT_INTERNAL, EXIT_RUN_FAILED
    from octopipe.execute.cli import simulate as simulate_cmd
    from octopipe.execute.runtime import RunFailed

    def failing(args: object) -> int:
        raise RunFailed("rank 1 failed at step 0 (1F0): boom (exit codes {})")

    monkeypatch.setattr(simulate_cmd, "run", failing)
    assert main(["simulate", "plan.txt"]) == EXIT_RUN_FAILED
    assert capsys.readouterr().err.strip() == (
        "octopipe: error: the run failed: rank 1 failed at step 0 (1F0): boom (exit codes {})"
    )

    def buggy(args: object) -> int:
        raise KeyError("oops")

    monkeypatch.setattr(simulate_cmd, "run", buggy)
    assert main(["simulate", "plan.txt"]) == EXIT_INTERNAL
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert err[-1].startswith("octopipe: error: internal error KeyError: 'oops' (a bug")
