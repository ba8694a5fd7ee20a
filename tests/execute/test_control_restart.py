"""A coordinator restart loses no run: records come back from its state folder, a running run is re-attached
when its nodes heartbeat again, and its metrics stream holds every step, from before the restart and after."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from octopipe.execute.control import Coordinator, CoordinatorConfig, NodeConfig, NodeDaemon, make_certs
from octopipe.execute.control.client import ControlClient
from octopipe.execute.processes import free_port
from octopipe.node.v1 import node_pb2
from tests.execute.control_cluster import llama_plan

pytestmark = pytest.mark.slow


def steps_reported(client: ControlClient, run_id: str, rank: int) -> int:
    return len({m.step for m in client.metrics(run_id, follow=False) if m.rank == rank})


def test_a_restarted_coordinator_keeps_its_runs_and_reattaches_a_running_one(tmp_path: Path) -> None:
    make_certs(tmp_path / "certs", nodes=["node0"])
    port = free_port()
    config = CoordinatorConfig(
        certs=tmp_path / "certs",
        state_dir=tmp_path / "coordinator",
        listen_port=port,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=1.5,
    )
    coordinator = Coordinator(config).start()
    node = NodeDaemon(
        NodeConfig(
            node_id="node0", coordinator=coordinator.address, certs=tmp_path / "certs", slots=2,
            work_dir=tmp_path / "node0", pin_cores=False, fence_after_s=20.0,
        )
    ).start()  # fmt: skip
    try:
        with ControlClient(coordinator.address, tmp_path / "certs") as client:
            finished = client.submit(llama_plan(2, 2), steps=1, run_id="finished")
            assert client.wait(finished, timeout_s=120).state == node_pb2.RUN_STATE_DONE
            # far more steps than it will run (the test cancels it): it cannot end while the coordinator is down,
            # however fast its steps
            long_run = client.submit(llama_plan(2, 4), steps=100_000, run_id="long")
            for run in client.watch(long_run, timeout_s=120):
                if run.completed_steps >= 1:
                    break
        coordinator.stop()
        coordinator = Coordinator(config).start()  # same state folder, same port
        with ControlClient(coordinator.address, tmp_path / "certs") as client:
            runs = {run.run_id: run for run in client.runs()}
            assert runs["finished"].state == node_pb2.RUN_STATE_DONE
            assert runs["long"].state == node_pb2.RUN_STATE_RUNNING
            before = runs["long"].completed_steps
            # re-attached: steps go on, and their metrics reach the restarted coordinator's stream
            deadline = time.monotonic() + 180
            while min(steps_reported(client, "long", rank) for rank in range(2)) < before + 5:
                assert time.monotonic() < deadline, f"no metrics past step {before + 5} within 180 s"
                assert client.run("long").state == node_pb2.RUN_STATE_RUNNING, client.run("long").error
                time.sleep(0.1)
            client.cancel("long", reason="enough steps")
            run = client.wait("long", timeout_s=60)
            assert run.state == node_pb2.RUN_STATE_CANCELLED, run.error
            # the metrics stream after the restart: those from before it (from the state folder), then the rest
            # (the node's stream followed again; what it replays is not kept twice): every rank's steps 0, 1, ...
            # with no gap and no repeat, past where the restart happened
            seen = [(m.rank, m.step) for m in client.metrics("long")]
            assert len(seen) == len(set(seen))
            for rank in range(2):
                steps = sorted(step for r, step in seen if r == rank)
                assert steps == list(range(len(steps))) and len(steps) >= before + 5, (rank, steps, before)
    finally:
        node.stop()
        coordinator.stop()
