"""Multi-host: two node daemons in separate network namespaces run a plan over veth links; a cut link is
detected, the run fails with the cause and every rank on both hosts is gone within the bound."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from octopipe.execute.control import LocalCluster, process_alive
from octopipe.execute.runtime import RunOptions, run_local
from octopipe.node.v1 import node_pb2
from tests.execute import netns
from tests.execute.control_cluster import llama_plan

# two network namespaces and a cut link (about 48 s): extended (CI runs it; ./scripts/test.sh --quick
# leaves it out); the loopback control-plane tests run in the quick loop too
pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.skipif(bool(netns.unavailable()), reason=netns.unavailable() or "ok"),
]


def test_two_hosts_run_a_plan_and_a_cut_link_stops_everything(tmp_path: Path) -> None:
    plan = llama_plan(2, 4)
    expected = run_local(plan, RunOptions(steps=2, pin_cores=False)).losses
    with netns.hosts(2) as (gateway, hosts):
        addresses = [gateway, *(h.address for h in hosts)]
        running = LocalCluster(tmp_path, listen_host=gateway, hosts=addresses)
        coordinator = running.coordinator
        try:
            for index, host in enumerate(hosts):
                running.node_process(f"host{index}", prefix=host.prefix, listen=f"{host.address}:0")
            with running.client() as client:
                run_id = client.submit(plan, steps=2)
                run = client.wait(run_id, timeout_s=180)
                assert run.state == node_pb2.RUN_STATE_DONE, run.error
                metrics = client.metrics(run_id)
                losses = [m.loss for m in sorted(metrics, key=lambda m: m.step) if m.rank == 1]
                assert losses == expected  # bitwise, over the veth link
                # cut host1 off in the middle of a long run
                long_run = client.submit(plan, steps=200, run_id="cut")
                for run in client.watch(long_run, timeout_s=120):
                    if run.completed_steps >= 1:
                        break
                pids = running.rank_pids("host0") + running.rank_pids("host1")
                cut_at = time.monotonic()
                netns.cut(hosts[1])
                run = client.wait(long_run, timeout_s=60)
                while "missed heartbeats" not in run.error and time.monotonic() - cut_at < 10:
                    time.sleep(0.05)
                    run = client.run(long_run)
                detected = time.monotonic() - cut_at
            assert run.state == node_pb2.RUN_STATE_FAILED
            assert "node host1" in run.error and "missed heartbeats" in run.error, run.error
            assert detected < coordinator.config.heartbeat_timeout_s + 2.0, detected
            # host0's ranks are stopped by the coordinator; host1's by its own daemon, which fences itself
            bound = 4.0 + 3.0 + 5.0  # fence-after + stop grace + slack
            while any(process_alive(pid) for pid in pids) and time.monotonic() - cut_at < bound:
                time.sleep(0.1)
            assert not [pid for pid in pids if process_alive(pid)], "ranks left running after the cut"
        finally:
            running.stop()


def test_a_cut_link_is_healed_onto_the_host_that_remains_bitwise(tmp_path: Path) -> None:
    from octopipe.execute.runtime.checkpoint import read_checkpoint
    from tests.execute.test_control_faults import assert_same_weights
    from tests.execute.test_control_recovery import AUTOMATIC, STEPS, all_metrics, check_losses, profile_of

    plan = llama_plan(2, 4)
    options = {"steps": STEPS, "checkpoint_every": 1, "profile": profile_of(plan), "recovery": AUTOMATIC}
    with netns.hosts(2, subnet="10.214.0") as (gateway, hosts):
        running = LocalCluster(tmp_path, listen_host=gateway, hosts=[gateway, *(h.address for h in hosts)])
        try:
            for index, host in enumerate(hosts):
                running.node_process(f"host{index}", prefix=host.prefix, listen=f"{host.address}:0")
            with running.client() as client:
                clean_id = client.submit(plan, run_id="clean", **options)  # type: ignore[arg-type]
                assert client.wait(clean_id, timeout_s=180).state == node_pb2.RUN_STATE_DONE
                run_id = client.submit(plan, run_id="cut", **options)  # type: ignore[arg-type]
                for run in client.watch(run_id, timeout_s=120):
                    if run.completed_steps >= 1:
                        break
                netns.cut(hosts[1])
                client.wait(run_id, timeout_s=180)
                run, clean = client.run(run_id), client.run(clean_id)
                metrics = all_metrics(client, run_id)
        finally:
            running.stop()
    assert run.state == node_pb2.RUN_STATE_DONE, run.error
    assert len(run.recoveries) == 1 and "node host1" in run.recoveries[0].cause, run.recoveries
    assert run.recoveries[0].kind == "replan" and list(run.recoveries[0].new_rank_nodes) == ["host0"]
    assert run.recoveries[0].resumed_from_step < STEPS
    check_losses(metrics, clean, run)
    root = running.config.state_dir / "checkpoints"
    assert_same_weights(read_checkpoint(root / "clean", STEPS), read_checkpoint(root / "cut", STEPS))
