"""Checkpoints of a pp x dp x ep run: every replica's shards and experts saved apart, and a resumed run
continues exactly where an uninterrupted one is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from octopipe.execute.runtime import RunOptions, run_local
from octopipe.execute.runtime.checkpoint import read_checkpoint
from tests.execute.test_mesh_runtime import mesh_plans

# 4 ranks on 2 cores, three launches (about 45 s): checkpoints of plain runs are checked in the quick
# loop too (tests/execute/test_control_faults.py resumes bitwise); this mesh variant is extended (CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_a_moe_mesh_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    plan = mesh_plans("moe-ep-4", ep=2)[0]
    whole = run_local(plan, RunOptions(steps=4, pin_cores=False, keep_params=True))
    run_local(plan, RunOptions(steps=2, pin_cores=False, checkpoint_dir=str(tmp_path), checkpoint_every=2))
    stored = read_checkpoint(tmp_path, 2)
    assert any("#replica1of2" in key for key in stored)  # the second replica's shards are there too
    resumed = run_local(
        plan,
        RunOptions(steps=2, pin_cores=False, keep_params=True, checkpoint_dir=str(tmp_path), start_step=2, resume=True),
    )
    assert sorted(resumed.params) == sorted(whole.params)
    for name, value in whole.params.items():
        assert torch.equal(resumed.params[name], value), name  # same ops in the same order: bitwise
    assert resumed.losses == whole.losses[2:]
