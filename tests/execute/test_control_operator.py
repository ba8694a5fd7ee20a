"""The control plane as an operator meets it: hostile names stay inside their folders, one coordinator per
address and state folder, one live daemon per node id, daemons that wait for their coordinator, and
one-line errors (never a traceback) for what an operator can get wrong. Real gRPC and TLS on loopback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.cli import EXIT_TIMED_OUT, EXIT_USAGE, main
from octopipe.execute.control import (
    ControlError,
    Coordinator,
    CoordinatorConfig,
    LocalCluster,
    NodeConfig,
    NodeDaemon,
    make_certs,
)
from octopipe.execute.control.security import CertPaths, secure_channel
from octopipe.execute.control.state import StateStore
from octopipe.execute.control.submission import run_id_problem
from octopipe.execute.processes import free_port
from octopipe.execute.runtime import reference_run
from octopipe.execute.runtime.measure import MEASURED_PID_OFFSET
from octopipe.ir import format_action, rank_actions, save_plan
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.simulate import local_cost_model, simulate, uniform_profile
from tests.execute.control_cluster import llama_plan


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("operator")
    with LocalCluster(root) as up:
        up.add_node("n0")
        yield up


def _printed(capsys: pytest.CaptureFixture[str], first: str) -> list[str]:
    """What a command printed, from its line starting with ``first`` (log lines share stdout in-process)."""
    lines = capsys.readouterr().out.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith(first)) :]


def _files(root: Path) -> set[Path]:
    return {p.resolve() for p in root.rglob("*")}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    run_id=st.one_of(
        st.text(min_size=1, max_size=80),
        st.sampled_from(["../../x", "..", ".", "/etc/x", "a/../../b", "a/b", "-x", "x" * 64, "ok-1.2_3"]),
    )
)
def test_hostile_run_ids_are_refused_and_nothing_lands_outside_the_folders(cluster: LocalCluster, run_id: str) -> None:
    outside = cluster.root.parent
    before = {p for p in _files(outside) if cluster.root.resolve() not in p.parents}
    with cluster.client() as client:
        if run_id_problem(run_id):
            with pytest.raises(ControlError) as caught:
                client.submit(llama_plan(1, 2), steps=1, run_id=run_id)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not allowed: use 1-63 letters" in str(caught.value)
            assert run_id not in {run.run_id for run in client.runs()}
        else:  # two ranks on a one-slot cluster: it stays queued, so cancelling it leaves no node busy
            client.submit(llama_plan(2, 4), steps=1, run_id=run_id)
            client.cancel(run_id)
    after = {p for p in _files(outside) if cluster.root.resolve() not in p.parents}
    assert after == before  # nothing written outside the cluster's state and work folders


def test_a_daemon_refuses_a_push_whose_names_would_leave_its_work_folder(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    stub = node_pb2_grpc.NodeServiceStub(secure_channel(node.address, CertPaths(cluster.certs, "coordinator")))
    for run_id, nonce, says in (("../escape", "n1", "is not allowed"), ("fine", "../../n", "nonce must be")):
        request = node_pb2.PushPlanRequest(
            run_id=run_id, version=1, nonce=nonce, plan=llama_plan(1, 2), num_steps=1,
            assignment=node_pb2.RankAssignment(ranks=[0], world_size=1, rendezvous_host="127.0.0.1"),
        )  # fmt: skip
        answer = stub.PushPlan(request, timeout=10)
        assert not answer.accepted and says in answer.reason
    assert not (cluster.root / "escape").exists() and not (cluster.root / "n").exists()


def test_a_second_coordinator_on_an_address_or_state_folder_in_use_exits_with_one_line(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = cluster.coordinator.address.rsplit(":", 1)[1]
    common = ["coordinator", "--certs", str(cluster.certs)]
    assert main([*common, "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "other")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"could not listen on 127.0.0.1:{port}: the address is in use" in err
    state = str(cluster.config.state_dir)
    assert main([*common, "--listen", "127.0.0.1:0", "--state-dir", state]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is held by another live coordinator" in err
    with cluster.client() as client:
        client.runs()  # the first one still answers


def test_a_second_live_daemon_with_a_nodes_id_is_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    first = cluster.coordinator.nodes()
    twin = NodeDaemon(
        NodeConfig(node_id="n0", coordinator=cluster.coordinator.address, certs=cluster.certs, work_dir=tmp_path)
    ).start()
    try:
        time.sleep(1.5)  # it keeps retrying, refused each time while n0 is alive
        assert cluster.coordinator.nodes() == first
        assert not twin._registered
    finally:
        twin.stop()


def test_a_daemon_started_before_its_coordinator_registers_when_it_comes_up(tmp_path: Path) -> None:
    make_certs(tmp_path / "certs", nodes=["early"])
    port = free_port()
    address = f"127.0.0.1:{port}"
    node = NodeDaemon(
        NodeConfig(node_id="early", coordinator=address, certs=tmp_path / "certs", work_dir=tmp_path / "node")
    ).start()
    try:
        time.sleep(1.0)
        config = CoordinatorConfig(certs=tmp_path / "certs", listen_port=port, state_dir=tmp_path / "state")
        coordinator = Coordinator(config).start()
        started = time.monotonic()
        try:
            while not coordinator.nodes() and time.monotonic() - started < 15:
                time.sleep(0.02)
            assert [n[0] for n in coordinator.nodes()] == ["early"]
        finally:
            coordinator.stop()
    finally:
        node.stop()


def test_operator_mistakes_get_one_line_and_no_traceback(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "plan.binpb"
    save_plan(llama_plan(1, 2), plan_file)
    client = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
    cases = [
        (["submit", str(plan_file), *client, "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["submit", str(plan_file), *client, "--steps", "-1"], "argument --steps: must be at least 1, got -1"),
        (["submit", str(plan_file), *client, "--run-id", "../../x"], "argument --run-id: run id '../../x'"),
        (["runs", "--coordinator", cluster.coordinator.address, "--certs", str(tmp_path / "none")], "is missing"),
        (["node", "--coordinator", "127.0.0.1:1", "--certs", str(cluster.certs), "--node-id", "n9", "--slots", "0"],
         "argument --slots: must be at least 1, got 0"),
        (["cancel", "a/b", *client], "argument run_id: run id 'a/b' is not allowed"),
    ]  # fmt: skip
    for argv, says in cases:
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)


def test_a_wait_that_runs_out_has_its_own_exit_code(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = llama_plan(2, 4)  # two ranks: one node of one slot never fits it, so it stays queued
    plan_file = tmp_path / "plan.binpb"
    save_plan(plan, plan_file)
    argv = ["submit", str(plan_file), "--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
    assert main([*argv, "--run-id", "waits", "--wait", "0.5"]) == EXIT_TIMED_OUT
    assert "the run goes on" in capsys.readouterr().err
    with cluster.client() as client:
        assert client.run("waits").state == node_pb2.RUN_STATE_QUEUED  # it went on (waiting for a second slot)
        assert client.cancel("waits").state == node_pb2.RUN_STATE_CANCELLED


def test_a_run_that_does_not_fit_says_why_and_does_not_hold_back_one_that_does(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster.client() as client:
        big = client.submit(llama_plan(2, 4), steps=1, run_id="too-big")  # 2 ranks, 1 slot registered
        small = client.submit(llama_plan(1, 2), steps=1, run_id="fits")
        assert client.wait(small, timeout_s=120).state == node_pb2.RUN_STATE_DONE
        deadline = time.monotonic() + 10  # the scheduler's next pass sees the slot idle again
        while "1 idle" not in (waiting := client.run(big)).waiting_for and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.state == node_pb2.RUN_STATE_QUEUED
        assert waiting.waiting_for.startswith("waiting for 2 slots: 1 registered on 1 live nodes, 1 idle")
        address, certs = cluster.coordinator.address, str(cluster.certs)
        assert main(["runs", "--coordinator", address, "--certs", certs]) == 0
        table = _printed(capsys, "RUN ")
        assert table[0].split()[:5] == ["RUN", "STATE", "VERSION", "STEPS", "CHECKPOINT"]
        row = next(line for line in table if line.startswith("too-big"))
        assert "queued" in row and "waiting for 2 slots" in row
        assert main(["runs", "fits", "--json", "--coordinator", address, "--certs", certs]) == 0
        data = json.loads(_printed(capsys, "{")[0])
        assert (data["run_id"], data["state"], data["completed_steps"]) == ("fits", "done", 1)
        assert main(["nodes", "--coordinator", address, "--certs", certs]) == 0
        lines = _printed(capsys, "NODE ")
        assert lines[0].split() == ["NODE", "ADDRESS", "SLOTS", "STATE", "HEARTBEAT", "RUN", "GPUS"]
        fields = lines[1].split()
        assert (fields[0], fields[2], fields[3]) == ("n0", "1", "alive")
        client.cancel(big)


def test_a_run_that_never_fits_fails_after_the_stated_time(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, never_fits_after_s=1.0) as small:
        small.add_node("only")
        with small.client() as client:
            run_id = client.submit(llama_plan(2, 4), steps=1)
            run = client.wait(run_id, timeout_s=30)
        assert run.state == node_pb2.RUN_STATE_FAILED
        assert "the run needs 2 slots but the live nodes have 1, for over 1 s" in run.error


def test_a_runs_own_queue_deadline_and_bad_recovery_options_are_refused_or_kept(tmp_path: Path) -> None:
    with LocalCluster(tmp_path) as small:  # the coordinator's default: 600 s
        small.add_node("only")
        with small.client() as client:
            run_id = client.submit(llama_plan(2, 4), steps=1, queue_deadline_s=0.5)
            run = client.wait(run_id, timeout_s=30)
            assert run.state == node_pb2.RUN_STATE_FAILED
            assert "the run needs 2 slots but the live nodes have 1, for over 0.5 s" in run.error
            with pytest.raises(ControlError, match="queue_deadline_s must be a finite number of seconds >= 0"):
                client.submit(llama_plan(1, 4), steps=1, queue_deadline_s=-1)
            with pytest.raises(ControlError, match="checkpoint_async and checkpoint_keep need checkpoint_every"):
                client.submit(llama_plan(1, 4), steps=1, checkpoint_async=True)
            lax = coordinator_pb2.RecoveryPolicy(wait_for_replacement_s=5)
            with pytest.raises(ControlError, match="sets limits but not automatic"):
                client.submit(llama_plan(1, 4), steps=1, recovery=lax)


def test_runs_and_nodes_as_json_are_lists_even_when_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with LocalCluster(tmp_path) as empty:
        client = ["--coordinator", empty.coordinator.address, "--certs", str(empty.certs), "--json"]
        assert main(["runs", *client]) == 0 and json.loads(_printed(capsys, "[")[0]) == []
        assert main(["nodes", *client]) == 0 and json.loads(_printed(capsys, "[")[0]) == []


def test_a_nodes_copied_folder_holds_no_ca_key_and_a_ca_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs = tmp_path / "certs"
    assert main(["certs", "make", str(certs), "--nodes", "a", "b"]) == 0
    assert not list(certs.glob("ca.key")) and (tmp_path / "certs-ca-key" / "ca.key").is_file()
    assert main(["certs", "copy", str(certs), "node-a", str(tmp_path / "for-a")]) == 0
    assert sorted(p.name for p in (tmp_path / "for-a").iterdir()) == ["ca.pem", "node-a.key", "node-a.pem"]
    capsys.readouterr()
    assert main(["certs", "make", str(certs)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already has a CA" in err and "--force" in err
    assert main(["certs", "node", str(certs), "c"]) == 0  # signed with the key kept beside the folder
    assert main(["certs", "show", str(certs)]) == 0
    shown = _printed(capsys, "IDENTITY")
    assert [line.split()[0] for line in shown[1:]] == ["admin", "coordinator", "node-a", "node-b", "node-c"]
    assert all("UTC (in 29 days)" in line or "UTC (in 30 days)" in line for line in shown[1:])
    assert main(["certs", "make", str(certs), "--force"]) == 0


def test_a_finished_runs_losses_from_the_cli_equal_the_local_launchers(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = llama_plan(1, 2)
    plan_file = tmp_path / "plan.binpb"
    save_plan(plan, plan_file)
    profile = uniform_profile(plan, forward_us=900.0)
    (tmp_path / "costs.binpb").write_bytes(profile.SerializeToString())
    client = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
    submit = ["submit", str(plan_file), *client, "--steps", "3", "--profile", str(tmp_path / "costs.binpb")]
    assert main([*submit, "--run-id", "results", "--wait", "120"]) == 0
    capsys.readouterr()
    assert main(["runs", "results", "--json", *client]) == 0
    data = json.loads(_printed(capsys, "{")[0])
    # bitwise: the local launcher's losses equal the single process's (test_runtime), so these must too
    expected = reference_run(plan.model, num_microbatches=plan.num_microbatches, steps=3).losses
    assert data["losses"] == expected
    assert len(data["step_times_us"]) == 3 and all(t > 0 for t in data["step_times_us"])
    predicted = simulate(plan, local_cost_model(plan, profile)).estimate.step_time_us
    assert data["predicted_step_time_us"] == predicted > 0
    assert main(["runs", "results", *client]) == 0
    said = _printed(capsys, "predicted")[0]
    assert said.startswith(f"predicted {predicted / 1e3:.2f} ms/step; measured ") and "error" in said
    profile.layers.pop()  # a profile without the head's costs cannot cost the plan: refused at submit
    (tmp_path / "costs.binpb").write_bytes(profile.SerializeToString())
    assert main(submit) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the profile has no costs for layers" in err
    assert main(["metrics", "results", *client]) == 0
    rows = _printed(capsys, "  STEP")[1:]
    assert [row.split()[:2] for row in rows] == [["0", "0"], ["1", "0"], ["2", "0"]]
    assert main(["metrics", "results", "--follow", "--json", *client]) == 0  # a finished run: all, then the end
    followed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    assert [(m["step"], m["loss"]) for m in followed] == list(enumerate(expected))
    trace = tmp_path / "run.json"
    assert main(["trace", "--run", "results", *client, "--out", str(trace), "--json"]) == 0
    written = json.loads("\n".join(_printed(capsys, "{")))  # printed over several lines
    assert written == {"files": {"trace": str(trace)}, "tracks": ["measured"], "step": 2}
    events = json.loads(trace.read_text())["traceEvents"]
    drawn = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == MEASURED_PID_OFFSET]
    # rank 0's last step: every action, in the order it ran
    assert drawn == [format_action(a) for a in rank_actions(plan)[0]]
    assert main(["trace", "--run", "results", *client, "--step", "7"]) == EXIT_USAGE
    assert "--step 7: the measured steps are 0 to 2" in capsys.readouterr().err


def test_stored_metrics_survive_a_torn_last_record(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    items = [node_pb2.StepMetrics(run_id="r", step=s, rank=0, loss=0.5 + s) for s in range(3)]
    for item in items:
        store.append_metrics("r", item)
    path = tmp_path / "runs" / "r" / "metrics.binpb"
    path.write_bytes(path.read_bytes() + b"\x40\x01")  # a record cut off by a crash
    assert store.load_metrics("r") == items


@pytest.mark.extended  # CI's budget: the metrics of a finished run are checked by default; this follows a live one
def test_metrics_follow_shows_every_step_of_a_running_run(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "plan.binpb"
    save_plan(llama_plan(1, 2), plan_file)
    client = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
    assert main(["submit", str(plan_file), *client, "--steps", "6", "--run-id", "followed"]) == 0
    with cluster.client() as control:
        assert control.run("followed").state in (node_pb2.RUN_STATE_QUEUED, node_pb2.RUN_STATE_STARTING)
    capsys.readouterr()
    assert main(["metrics", "followed", "--follow", "--json", *client]) == 0  # from before its first step to its end
    followed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    assert [m["step"] for m in followed] == list(range(6))
    with cluster.client() as control:
        assert control.run("followed").state == node_pb2.RUN_STATE_DONE


def test_runs_shows_the_checkpoint_step_as_the_run_goes_and_a_refusal_in_the_clis_words(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster.client() as control:
        # far more steps than it takes to see one checkpoint: the run is still going when the first one shows
        run_id = control.submit(llama_plan(1, 2), steps=10_000, run_id="checkpoints", checkpoint_every=2)
        deadline = time.monotonic() + 120
        while (run := control.run(run_id)).last_checkpoint_step == 0:
            assert run.state in (node_pb2.RUN_STATE_QUEUED, node_pb2.RUN_STATE_STARTING, node_pb2.RUN_STATE_RUNNING)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert run.state == node_pb2.RUN_STATE_RUNNING and run.completed_steps < 10_000  # shown as the run goes
        assert run.last_checkpoint_step % 2 == 0
        control.cancel(run_id)
        waiting = control.submit(llama_plan(2, 4), steps=1, run_id="no-checkpoints")  # never fits: stays queued
        control.cancel(waiting)
    client = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
    capsys.readouterr()
    assert main(["resume", "no-checkpoints", *client]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "submit with --checkpoint-every > 0" in err, err
    assert "FAILED_PRECONDITION" not in err and "checkpoint_every" not in err
