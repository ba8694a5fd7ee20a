"""``octopipe run --torchrun`` under a real torchrun launch: a pp=2 plan on 2 processes and a
pp=2 x dp=2 mesh plan on 4 (extended: CI runs it, ``./scripts/test.sh --quick`` leaves it out).

torchrun starts the ranks (its agent holds the rendezvous store); each rank joins with
``octopipe run PLAN --torchrun`` and writes its results. The pipeline's losses must be bitwise the single
process's; the mesh's bitwise those of the same plan run by ``run_local`` (the same program on the same
number of processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octopipe.execute.runtime import RunOptions, build_model, reference_run, run_local, workload_reference
from octopipe.execute.train_config import load_train_config
from octopipe.ir import mesh_spec, save_plan, with_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import CollectivePlacement, equal_partition, one_f_one_b

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _mesh_plan() -> plan_pb2.Plan:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=8)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(2, 2, layer_names=equal_partition(names, 2))
    plan.model.CopyFrom(reference)
    plan.mesh.dp = 2
    return with_collectives(plan, CollectivePlacement(prefetch=False, ahead=1, reshard=True))


def _torchrun(plan_file: Path, out: Path, processes: int) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "octopipe.execute", "run", str(plan_file), "--torchrun", "--steps", "2", "--no-pin",
        "--timeout", "120", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)


def test_torchrun_runs_a_pipeline_plan_bitwise_as_the_single_process(tmp_path: Path) -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=4)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(2, 2, layer_names=equal_partition(names, 2))
    plan.model.CopyFrom(reference)
    save_plan(plan, tmp_path / "plan.binpb")
    done = _torchrun(tmp_path / "plan.binpb", tmp_path / "out", 2)
    assert done.returncode == 0, done.stderr[-4000:]
    last = torch.load(tmp_path / "out" / "rank1.pt", weights_only=True)[0]["losses"]
    # bitwise the single process's, as the local launcher's are (test_runtime)
    assert last == reference_run(reference, num_microbatches=2, steps=2).losses


@pytest.mark.extended  # 4 processes twice (about 40 s): the mesh runtime runs by default under run_local
def test_torchrun_runs_a_mesh_plan_as_run_local_does(tmp_path: Path) -> None:
    plan = _mesh_plan()
    mesh = mesh_spec(plan)
    assert mesh.world_size == 4
    save_plan(plan, tmp_path / "plan.binpb")
    done = _torchrun(tmp_path / "plan.binpb", tmp_path / "out", mesh.world_size)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True)[0] for r in range(mesh.world_size)]
    last = [results[mesh.global_rank(plan.stages[-1].rank, d)]["losses"] for d in range(mesh.dp)]
    losses = [sum(step) / mesh.dp for step in zip(*last, strict=True)]
    expected = run_local(plan, RunOptions(steps=2, pin_cores=False, timeout_s=120)).losses
    assert losses == expected  # bitwise: the same program on the same processes


def test_torchrun_with_the_wrong_process_count_names_the_one_needed(tmp_path: Path) -> None:
    save_plan(_mesh_plan(), tmp_path / "plan.binpb")
    done = _torchrun(tmp_path / "plan.binpb", tmp_path / "out", 2)
    assert done.returncode != 0
    assert (
        "the launch has 2 ranks but the plan needs 4 (2 pipeline ranks x 2 replicas, context and tensor ranks)"
        in done.stderr
    )


@pytest.mark.slow
@pytest.mark.extended  # another launch of 2 processes (CI's budget); the default test above joins torchrun the same way
def test_torchrun_trains_a_config_and_rank_zero_writes_the_metrics(tmp_path: Path) -> None:
    """``octopipe train CONFIG --torchrun``: each process is a rank; rank 0 gathers the ranks' results and
    writes metrics.jsonl, whose losses and norms are bitwise the single process's."""
    config = tmp_path / "train.toml"
    config.write_text(
        "[model]\nworkload = 'llama-8'\nsequence = 16\nglobal_batch = 4\n[data]\nmax_bytes = 40000\n"
        "[plan]\nschedule = '1f1b'\nmicrobatches = 2\n[metrics]\ntensorboard = false\npeak_gflops = 10.0\n"
        "[run]\ntimeout_s = 120.0\n"
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "octopipe.execute", "train", str(config), "--torchrun", "--steps", "2", "--json",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    loaded = load_train_config(config)
    reference = workload_reference("llama-8", tiny=True, vocab=256, sequence=16, global_batch=4)
    ref = reference_run(reference, num_microbatches=2, steps=2, optimization=loaded.optimization(2), data=loaded.data())
    assert [r["loss"] for r in rows] == ref.losses and [r["grad_norm"] for r in rows] == ref.grad_norms
    assert all(r["step_ms"] > 0 and r["mfu"] > 0 for r in rows)
