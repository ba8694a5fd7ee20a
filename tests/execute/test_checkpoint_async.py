"""Checkpoints under the commit protocol: asynchronous saves equal synchronous ones bitwise, a save whose rank
was killed mid-write is never loaded, and the commit (replace, keep K) on real folders.

The runs are 2 real gloo ranks of the tiny llama-8 (``run_local``); the kill is a SIGKILL of rank 1's
process while its background write of one step is held open (``RunOptions.checkpoint_hold``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from octopipe.execute.checkpoint_files import (
    checkpoint_path,
    commit_checkpoint,
    committed_checkpoints,
    latest_checkpoint,
    partial_path,
    prune_checkpoints,
)
from octopipe.execute.runs import StepTimeline
from octopipe.execute.runtime import RunFailed, RunOptions, RunResult, run_local
from octopipe.execute.runtime.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from octopipe.execute.runtime.checkpointer import Checkpointer, CheckpointError
from tests.execute.control_cluster import llama_plan
from tests.transform.gloo import run_ranks

STEPS = 4


def _options(folder: Path, **changes: object) -> RunOptions:
    base: dict[str, object] = {
        "steps": STEPS,
        "pin_cores": False,
        "keep_params": True,
        "checkpoint_dir": str(folder),
        "checkpoint_every": 1,
    }
    return RunOptions(**{**base, **changes})  # type: ignore[arg-type]


def _assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(expected) == sorted(actual), what
    for key, value in expected.items():
        assert torch.equal(value, actual[key]), f"{what}: {key}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    """A synchronous run checkpointing every step: the reference for every other run here."""
    folder = tmp_path_factory.mktemp("sync")
    return run_local(llama_plan(2, 4), _options(folder)), folder


# ---- the commit protocol on folders (no processes) ----


def _fake_checkpoint(folder: Path, tag: str, *, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_text(tag)
    if complete:
        (folder / ".metadata").write_text(tag)
    return folder


def test_a_commit_renames_the_partial_folder_and_replaces_a_committed_one(tmp_path: Path) -> None:
    _fake_checkpoint(checkpoint_path(tmp_path, 2), "old")
    partial = _fake_checkpoint(partial_path(tmp_path, 2, "ab12"), "new")
    assert latest_checkpoint(tmp_path) == 2  # the old one, while the new one is only partial
    assert commit_checkpoint(partial, 2) == checkpoint_path(tmp_path, 2)
    assert (checkpoint_path(tmp_path, 2) / "__0_0.distcp").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]  # nothing aside, nothing partial left
    # an unfinished save (no .metadata) is refused and left as it is
    unfinished = _fake_checkpoint(partial_path(tmp_path, 3, "cd34"), "half", complete=False)
    with pytest.raises(FileNotFoundError, match=r"step-3\.partial-cd34 has no \.metadata"):
        commit_checkpoint(unfinished, 3)
    assert unfinished.is_dir() and latest_checkpoint(tmp_path) == 2
    # a step-<n> folder without .metadata (written before this protocol, its writer died) is replaced
    _fake_checkpoint(checkpoint_path(tmp_path, 4), "legacy", complete=False)
    commit_checkpoint(_fake_checkpoint(partial_path(tmp_path, 4, "ef56"), "new4"), 4)
    assert (checkpoint_path(tmp_path, 4) / "__0_0.distcp").read_text() == "new4"
    assert latest_checkpoint(tmp_path) == 4
    with pytest.raises(ValueError, match="lowercase hex"):
        partial_path(tmp_path, 1, "../x")


def test_only_committed_folders_count_and_keep_deletes_only_older_committed_ones(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5, 8):
        _fake_checkpoint(checkpoint_path(tmp_path, step), str(step))
    _fake_checkpoint(partial_path(tmp_path, 9, "aa"), "finished but not committed")  # has .metadata
    _fake_checkpoint(partial_path(tmp_path, 1, "bb"), "another attempt's", complete=False)
    _fake_checkpoint(tmp_path / "step-10.replaced-cc", "aside")
    _fake_checkpoint(checkpoint_path(tmp_path, 7), "half", complete=False)
    assert committed_checkpoints(tmp_path) == [1, 2, 3, 4, 5, 8]
    assert latest_checkpoint(tmp_path) == 8
    assert prune_checkpoints(tmp_path, 0, newest=5) == []
    # the run just committed 5 (resumed from an earlier step): 8, a later one, is kept
    assert prune_checkpoints(tmp_path, 2, newest=5) == [1, 2, 3]
    assert committed_checkpoints(tmp_path) == [4, 5, 8]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "step-1.partial-bb",
        "step-10.replaced-cc",
        "step-4",
        "step-5",
        "step-7",
        "step-8",
        "step-9.partial-aa",
    ]
    with pytest.raises(ValueError, match="keep must be >= 0"):
        prune_checkpoints(tmp_path, -1, newest=5)
    assert latest_checkpoint(tmp_path / "nothing") == 0


def test_a_single_process_save_is_committed_and_reads_back(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    with pytest.warns(UserWarning, match="single process"):  # no process group: torch says so
        path = save_checkpoint(tmp_path, 1, {"w": weight}, optimizer)
    assert path == checkpoint_path(tmp_path, 1) and (path / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    stored = read_checkpoint(tmp_path, 1)
    assert torch.equal(stored["param/w"], weight.detach())
    assert torch.equal(stored["exp_avg/w"], optimizer.state[weight]["exp_avg"])
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        read_checkpoint(tmp_path, 2)


# ---- the Checkpointer on 2 real gloo ranks ----


def _checkpointer_ranks(rank: int, world: int, folder: str) -> None:
    """Asynchronous saves with the weights updated in place right after each (as the optimizer does)."""
    weight = torch.nn.Parameter(torch.full((4,), float(rank)))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    saver = Checkpointer(folder, asynchronous=True, keep=2, timeout_s=60)
    for step in (1, 2, 3):
        saver.save(step, {f"w{rank}": weight}, optimizer)
        with torch.no_grad():
            weight.add_(100.0)  # while the background write may still run: the copy must not see this
    saver.close()
    torch.distributed.barrier()
    # a save that fails in the background (the folder is under a file) fails the next save, then finish
    blocked = Path(folder) / "a-file"
    if rank == 0:
        blocked.write_text("not a folder")
    torch.distributed.barrier()
    broken = Checkpointer(blocked / "checkpoints", asynchronous=True, timeout_s=60)
    broken.save(1, {f"w{rank}": weight}, optimizer)
    try:
        broken.save(2, {f"w{rank}": weight}, optimizer)
    except CheckpointError as exc:
        assert "the checkpoint of step 1 failed" in str(exc), exc
    else:
        raise AssertionError("a failed background save was not reported by the next save")
    broken.close()  # nothing in flight any more: the error was reported once
    try:
        broken.save(3, {f"w{rank}": weight}, optimizer)
    except CheckpointError as exc:
        assert "was closed" in str(exc), exc
    else:
        raise AssertionError("a closed Checkpointer started a save")


def test_asynchronous_saves_hold_the_state_of_their_step_and_keep_the_newest(tmp_path: Path) -> None:
    run_ranks(_checkpointer_ranks, 2, str(tmp_path))  # two spawned ranks: 3 s on 2 quiet cores
    assert committed_checkpoints(tmp_path) == [2, 3]  # keep=2 deleted step 1
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    for step in (2, 3):
        stored = read_checkpoint(tmp_path, step)
        for rank in (0, 1):
            assert torch.equal(stored[f"param/w{rank}"], torch.full((4,), rank + 100.0 * (step - 1))), (step, rank)


# ---- whole runs: 2 gloo ranks of the tiny llama-8 ----


# three launches of 2 ranks, the fixture's included: 12 s on 2 quiet cores, 28 s on busy ones; extended (CI
# runs it; --quick leaves it out): the interrupted save below, in the quick loop too, resumes bitwise from an asynchronous checkpoint too
@pytest.mark.slow
@pytest.mark.extended
def test_asynchronous_checkpoints_equal_synchronous_ones_and_resume_bitwise(
    tmp_path: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    whole, sync_folder = uninterrupted
    plan = llama_plan(2, 4)
    run = run_local(plan, _options(tmp_path, checkpoint_async=True))
    assert run.losses == whole.losses
    _assert_same(whole.params, run.params, "final weights")
    assert [t.checkpoint for t in run.timelines[0]] == [1, 2, 3, 4]  # each step started its save
    assert committed_checkpoints(tmp_path) == [1, 2, 3, 4]  # the run ended with its last one committed
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    for step in range(1, STEPS + 1):
        _assert_same(read_checkpoint(sync_folder, step), read_checkpoint(tmp_path, step), f"step {step}")
    resumed = run_local(plan, _options(tmp_path, steps=2, start_step=2, resume=True, checkpoint_async=True))
    assert resumed.losses == whole.losses[2:]
    _assert_same(whole.params, resumed.params, "resumed final weights")
    _assert_same(read_checkpoint(sync_folder, STEPS), read_checkpoint(tmp_path, STEPS), "re-saved last step")


def _kill_rank_mid_write(folder: Path, rank: int, step: int, timeline: StepTimeline, done: list[float]) -> None:
    """``on_step``: once ``rank`` has started its save of ``step`` and its data file is on disk, SIGKILL it."""
    if timeline.rank != rank or timeline.checkpoint != step or done:
        return
    deadline = time.monotonic() + 60
    while not list(folder.glob(f"step-{step}.partial-*/__{rank}_*.distcp")):
        assert time.monotonic() < deadline, "rank 1's checkpoint data never appeared"
        time.sleep(0.01)
    (process,) = [p for p in multiprocessing.active_children() if p.name == f"octopipe-rank{rank}"]
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    done.append(time.monotonic())


@pytest.mark.slow  # two launches of 2 ranks: 7 s on 2 quiet cores, 12 s on busy ones
def test_a_checkpoint_interrupted_mid_write_is_never_loaded_and_resume_is_bitwise(
    tmp_path: Path, uninterrupted: tuple[RunResult, Path]
) -> None:
    whole, sync_folder = uninterrupted
    plan = llama_plan(2, 4)
    interrupted, killed = 3, 1
    # rank 1 holds its write of step 3 open for a minute after writing its data: the kill lands inside it
    options = _options(tmp_path, checkpoint_async=True, checkpoint_hold={killed: (interrupted, 60.0)})
    done: list[float] = []
    with pytest.raises(RunFailed):
        run_local(plan, options, on_step=lambda t: _kill_rank_mid_write(tmp_path, killed, interrupted, t, done))
    assert done, "rank 1 was never killed"
    (partial,) = tmp_path.glob(f"step-{interrupted}.partial-*")  # the interrupted save, left as it was
    assert not (partial / ".metadata").exists() and list(partial.glob(f"__{killed}_*.distcp"))
    assert not checkpoint_path(tmp_path, interrupted).exists()
    assert latest_checkpoint(tmp_path) == interrupted - 1 == committed_checkpoints(tmp_path)[-1]
    weight = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(FileNotFoundError, match=rf"no complete checkpoint at .*step-{interrupted}.*latest .* step 2"):
        load_checkpoint(tmp_path, interrupted, {"w": weight}, torch.optim.AdamW([weight]))
    start = latest_checkpoint(tmp_path)
    resumed = run_local(
        plan, _options(tmp_path, steps=STEPS - start, start_step=start, resume=True, checkpoint_async=True)
    )
    assert resumed.losses == whole.losses[start:]
    _assert_same(whole.params, resumed.params, "final weights after the resume")
    _assert_same(read_checkpoint(sync_folder, interrupted), read_checkpoint(tmp_path, interrupted), "step 3 again")
    assert partial.is_dir()  # another attempt's partial folder is left alone


def test_run_options_check_the_checkpoint_settings() -> None:
    with pytest.raises(ValueError, match="checkpoint_async needs checkpoint_every > 0"):
        RunOptions(checkpoint_async=True, checkpoint_dir="x")
    with pytest.raises(ValueError, match="checkpoint_keep must be >= 0"):
        RunOptions(checkpoint_keep=-1)
    with pytest.raises(ValueError, match="checkpoint_hold's seconds must be >= 0"):
        RunOptions(checkpoint_hold={0: (1, -1.0)})
