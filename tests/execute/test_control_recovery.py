"""Self-healing runs: a run with an automatic recovery policy that loses one of its two daemons (SIGKILL) is
re-planned onto the survivor and finishes with no person involved, also when the coordinator restarts during
the recovery; final weights and optimizer state are bitwise those of an uninterrupted run (checkpoints written
asynchronously, every step)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.control import LocalCluster, process_alive
from octopipe.execute.control.client import ControlClient
from octopipe.execute.runtime.checkpoint import read_checkpoint
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from tests.execute.control_cluster import llama_plan
from tests.execute.test_control_faults import assert_same_weights, wait_for_step

pytestmark = pytest.mark.slow

STEPS, EVERY = 16, 1
AUTOMATIC = coordinator_pb2.RecoveryPolicy(automatic=True)


def profile_of(plan: plan_pb2.Plan) -> profile_pb2.Profile:
    """The plan's model profiled on this machine (what `octopipe profile` measures; re-planning needs it)."""
    return profile_reference(plan.model, num_microbatches=plan.num_microbatches, repeats=2)


@pytest.fixture(scope="module")
def profile() -> profile_pb2.Profile:
    return profile_of(llama_plan(2, 4))


def wait_for_state(client: ControlClient, run_id: str, state: int, timeout_s: float = 60) -> coordinator_pb2.Run:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.run(run_id)
        if run.state == state:
            return run
        assert run.state not in (node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_DONE), run.error
        time.sleep(0.05)
    raise TimeoutError(f"run {run_id} did not reach state {state} within {timeout_s} s")


def all_metrics(client: ControlClient, run_id: str) -> list[node_pb2.StepMetrics]:
    """The run's metrics once its last step's have arrived (the streams are a moment behind its state)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = client.metrics(run_id)
        if any(m.step == STEPS - 1 and m.has_loss for m in metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def wait_for_file(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def check_recovered(run: coordinator_pb2.Run, clean: coordinator_pb2.Run) -> None:
    assert run.state == node_pb2.RUN_STATE_DONE, run.error
    assert run.completed_steps == STEPS and list(run.rank_nodes) == ["node0"]
    assert len(run.recoveries) == 1, run.recoveries
    record = run.recoveries[0]
    assert "node node1" in record.cause, record.cause
    assert record.kind == "replan" and list(record.old_rank_nodes) == ["node0", "node1"]
    assert list(record.new_rank_nodes) == ["node0"] and "on 1 ranks" in record.new_plan, record
    assert record.resumed_from_step >= 1 and record.failed_at_step >= record.resumed_from_step
    assert record.resumed_from_step < STEPS, record  # the kill landed before the end
    assert record.lost_seconds > 0 and record.predicted_step_us > 0 and record.measured_step_us > 0, record


def check_losses(metrics: list[node_pb2.StepMetrics], clean: coordinator_pb2.Run, run: coordinator_pb2.Run) -> None:
    """Every step the healed attempt ran has the uninterrupted run's loss; so has every earlier step whose loss
    reached the coordinator (a killed node's last metrics may not have)."""
    healed = run.recoveries[-1]
    latest: dict[int, tuple[int, float]] = {}
    for m in metrics:
        if m.has_loss and m.plan_version >= latest.get(m.step, (0, 0.0))[0]:
            latest[m.step] = (m.plan_version, m.loss)
    assert all(latest[s][0] == healed.plan_version for s in range(healed.resumed_from_step, STEPS))
    assert {s: loss for s, (_, loss) in latest.items()} == {s: clean.losses[s] for s in latest}


def killed_and_healed(tmp_path: Path, profile: profile_pb2.Profile, *, restart: bool) -> None:
    plan = llama_plan(2, 4)
    with LocalCluster(tmp_path) as running:
        running.node_process("node0")
        second = running.node_process("node1")
        with running.client() as client:
            options = {"steps": STEPS, "checkpoint_every": EVERY, "checkpoint_async": True, "profile": profile}
            options["recovery"] = AUTOMATIC
            clean_id = client.submit(plan, run_id="clean", **options)  # type: ignore[arg-type]
            clean = client.wait(clean_id, timeout_s=180)
            assert clean.state == node_pb2.RUN_STATE_DONE, clean.error
            run_id = client.submit(plan, run_id="killed", **options)  # type: ignore[arg-type]
            wait_for_step(client, run_id, 1)  # killed early: a tiny step takes tens of ms
            # and after a checkpoint is committed (asynchronous ones commit a moment after their step), so the
            # recovery has one to resume from, whatever the timing
            committed = running.coordinator.config.state_dir / "checkpoints" / "killed" / "step-1" / ".metadata"
            wait_for_file(committed)
            pids = running.rank_pids("node1")
            second.kill()
            second.wait(timeout=10)
            if restart:  # the coordinator goes down in the middle of the recovery
                wait_for_state(client, run_id, node_pb2.RUN_STATE_RECOVERING)
        if restart:
            running.restart_coordinator()
        with running.client() as client:
            client.wait(run_id, timeout_s=180)
            run, clean = client.run(run_id), client.run(clean_id)  # GetRun: with the losses
            metrics = all_metrics(client, run_id)
        assert not [pid for pid in pids if process_alive(pid)]
        check_recovered(run, clean)
        check_losses(metrics, clean, run)
        root = running.coordinator.config.state_dir / "checkpoints"
        assert_same_weights(read_checkpoint(root / "clean", STEPS), read_checkpoint(root / "killed", STEPS))


def test_a_killed_daemon_is_replanned_onto_the_survivor_bitwise(tmp_path: Path, profile: profile_pb2.Profile) -> None:
    killed_and_healed(tmp_path, profile, restart=False)


@pytest.mark.extended
def test_a_coordinator_restart_during_recovery_still_heals_the_run(
    tmp_path: Path, profile: profile_pb2.Profile
) -> None:
    killed_and_healed(tmp_path, profile, restart=True)
