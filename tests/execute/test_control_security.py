"""Mutual TLS, roles, node identities and bad input: refused with a clear status, nothing runs, and the
coordinator keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.cli import main
from octopipe.execute.control import (
    ControlClient,
    ControlError,
    Coordinator,
    CoordinatorConfig,
    LocalCluster,
    NodeConfig,
    NodeDaemon,
    make_certs,
)
from octopipe.execute.control.pushes import RunPusher
from octopipe.execute.control.security import (
    MAX_MESSAGE_BYTES,
    CertPaths,
    channel_options,
    node_identity,
    secure_channel,
)
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.plan.v1 import plan_pb2
from tests.execute.control_cluster import llama_plan


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("security")
    with LocalCluster(root) as up:
        up.add_node("node0")
        up.add_node("node1")
        yield up


def stub(
    running: LocalCluster, identity: str = "admin", certs: Path | None = None
) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    channel = secure_channel(running.coordinator.address, CertPaths(certs or running.certs, identity))
    return coordinator_pb2_grpc.CoordinatorServiceStub(channel)


def still_serving(running: LocalCluster) -> None:
    with running.client() as client:
        client.runs()  # an authorized call still works
    channel = secure_channel(running.coordinator.address, CertPaths(running.certs, "admin"))
    check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[attr-defined]
    health = check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_without_a_certificate_is_refused_at_the_handshake(running: LocalCluster) -> None:
    ca = (running.certs / "ca.pem").read_bytes()
    channel = grpc.secure_channel(running.coordinator.address, grpc.ssl_channel_credentials(root_certificates=ca))
    with pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListRuns(coordinator_pb2.ListRunsRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    still_serving(running)


def test_a_plaintext_client_is_refused(running: LocalCluster) -> None:
    channel = grpc.insecure_channel(running.coordinator.address)
    with pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListRuns(coordinator_pb2.ListRunsRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    still_serving(running)


def test_a_certificate_from_another_ca_is_refused(running: LocalCluster, tmp_path: Path) -> None:
    make_certs(tmp_path / "other")
    # the client trusts the right CA for the server, but presents a certificate the cluster's CA did not sign
    other = CertPaths(tmp_path / "other", "admin")
    _, cert, key = other.read()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(running.certs / "ca.pem").read_bytes(), private_key=key, certificate_chain=cert
    )
    channel = grpc.secure_channel(running.coordinator.address, credentials, options=channel_options())
    with pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListRuns(coordinator_pb2.ListRunsRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # and the client error says what to check
    with ControlClient(running.coordinator.address, tmp_path / "other") as client, pytest.raises(ControlError) as error:
        client.runs()
    assert "cluster's CA" in str(error.value) or "check that the coordinator runs" in str(error.value)
    still_serving(running)


def test_a_node_certificate_cannot_submit_and_an_admin_cannot_register(running: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        submit = coordinator_pb2.SubmitPlanRequest(plan=llama_plan(), num_steps=1)
        stub(running, node_identity("node0")).SubmitPlan(submit, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "role" in (caught.value.details() or "")
    with pytest.raises(grpc.RpcError) as caught:
        request = coordinator_pb2.RegisterNodeRequest(
            node_id="evil", address="127.0.0.1:1", devices=[coordinator_pb2.Device(kind="cpu")]
        )
        stub(running, "admin").RegisterNode(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "evil" not in [n for n, _, _ in running.coordinator.nodes()]
    # a node daemon's own service refuses an admin certificate too
    node = running.nodes[0]
    channel = secure_channel(node.address, CertPaths(running.certs, "admin"))
    with pytest.raises(grpc.RpcError) as caught:
        node_pb2_grpc.NodeServiceStub(channel).GetNodeStatus(node_pb2.GetNodeStatusRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    still_serving(running)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.ClearField("stages"), "no stages"),
        (lambda p: setattr(p, "num_microbatches", 0), "micro-batch"),
        (lambda p: p.ranks[0].actions.pop(0), "does not verify"),
        (lambda p: p.model.Clear(), "names no model"),
        (lambda p: setattr(p, "num_microbatches", 1 << 20), "at most"),
        (lambda p: setattr(p.mesh, "ep", 3), "does not divide"),
    ],
)
def test_bad_plans_are_refused_with_the_reason(running: LocalCluster, change, message: str) -> None:  # type: ignore[no-untyped-def]
    plan = llama_plan()
    change(plan)
    with running.client() as client, pytest.raises(ControlError) as caught:
        client.submit(plan, steps=1)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(caught.value)
    still_serving(running)


def test_oversized_and_malformed_messages_are_refused(running: LocalCluster) -> None:
    channel = secure_channel(running.coordinator.address, CertPaths(running.certs, "admin"))
    submit = channel.unary_unary(
        "/octopipe.coordinator.v1.CoordinatorService/SubmitPlan",
        request_serializer=lambda raw: raw,
        response_deserializer=coordinator_pb2.SubmitPlanResponse.FromString,
    )
    big = coordinator_pb2.SubmitPlanRequest(
        plan=plan_pb2.Plan(name="x" * (MAX_MESSAGE_BYTES + 16)), num_steps=1
    ).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        submit(big, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as caught:
        submit(b"\xff\xff\xff\xff\x0f garbage", timeout=5)
    assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    # unknown fields (a newer client) are kept by proto3 and ignored: the plan is judged on what we know
    plan = llama_plan()
    raw = coordinator_pb2.SubmitPlanRequest(plan=plan, num_steps=1, run_id="unknown-fields").SerializeToString()
    raw += bytes([0xF8, 0x07, 0x01])  # field 127, varint 1
    response = submit(raw, timeout=10)
    assert response.run_id == "unknown-fields"
    with running.client() as client:
        client.cancel("unknown-fields")
    still_serving(running)


def test_a_nack_fails_the_run_with_the_nodes_reason(running: LocalCluster) -> None:
    plan = llama_plan(1, 2)
    plan.model.source = "somewhere.else:build"  # the node does not allow this model source
    plan.model.name = "custom"
    with running.client() as client:
        run_id = client.submit(plan, steps=1)
        run = client.wait(run_id, timeout_s=30)
    assert run.state == node_pb2.RUN_STATE_FAILED
    assert "refused the plan" in run.error and "--allow-model-source somewhere.else:build" in run.error
    still_serving(running)


def test_re_pushes_with_the_same_nonce_are_idempotent_and_old_versions_refused(running: LocalCluster) -> None:
    node = running.nodes[0]
    channel = secure_channel(node.address, CertPaths(running.certs, "coordinator"))
    node_stub = node_pb2_grpc.NodeServiceStub(channel)
    plan = llama_plan(1, 2)
    request = node_pb2.PushPlanRequest(
        run_id="direct", version=2, nonce="n1", plan=plan, num_steps=1,
        assignment=node_pb2.RankAssignment(ranks=[0], world_size=1, rendezvous_host="127.0.0.1"),
    )  # fmt: skip
    first = node_stub.PushPlan(request, timeout=30)
    again = node_stub.PushPlan(request, timeout=30)
    assert first.accepted and again == first
    older = node_pb2.PushPlanRequest()
    older.CopyFrom(request)
    older.version, older.nonce = 1, "n2"
    answer = node_stub.PushPlan(older, timeout=30)
    assert not answer.accepted and "not newer" in answer.reason
    stopped = node_stub.StopRun(node_pb2.StopRunRequest(run_id="direct"), timeout=30)
    assert stopped.state in (node_pb2.RUN_STATE_CANCELLED, node_pb2.RUN_STATE_DONE)


def daemon(running: LocalCluster, node_id: str, identity: str) -> node_pb2_grpc.NodeServiceStub:
    """A stub of node ``node_id``'s daemon, called with the certificate ``identity``."""
    node = next(n for n in running.nodes if n.config.node_id == node_id)
    return node_pb2_grpc.NodeServiceStub(secure_channel(node.address, CertPaths(running.certs, identity)))


def direct_push(run_id: str, num_steps: int = 1) -> node_pb2.PushPlanRequest:
    """A push a daemon accepts (one rank, its own rendezvous store); ``num_steps`` 0 runs until stopped."""
    return node_pb2.PushPlanRequest(
        run_id=run_id, version=1, nonce=run_id, plan=llama_plan(1, 2), num_steps=num_steps,
        assignment=node_pb2.RankAssignment(ranks=[0], world_size=1, rendezvous_host="127.0.0.1"),
    )  # fmt: skip


def refused(code: grpc.StatusCode, method: Callable[..., Any], request: object) -> str:
    """Call ``method`` (reading a stream to its end), check it fails with ``code``; return the status details."""
    with pytest.raises(grpc.RpcError) as caught:
        answer = method(request, timeout=5)
        if hasattr(answer, "__next__"):
            list(answer)
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details() or ""


@pytest.mark.parametrize("caller", ["node0", "node1", "admin"])
def test_only_the_coordinator_certificate_drives_a_daemon(running: LocalCluster, caller: str) -> None:
    identity = "admin" if caller == "admin" else node_identity(caller)
    role = "admin" if caller == "admin" else "node"
    for target in ("node0", "node1"):  # another node's daemon, and its own
        stub = daemon(running, target, identity)
        switch = direct_push(f"evil-{caller}")
        switch.switch_plan = True
        calls: list[tuple[Callable[..., Any], object]] = [
            (stub.PushPlan, direct_push(f"evil-{caller}")),
            (stub.PushPlan, switch),
            (stub.StopRun, node_pb2.StopRunRequest(run_id="any", reason="evil")),
            (stub.GetNodeStatus, node_pb2.GetNodeStatusRequest()),
            (stub.StreamNodeMetrics, node_pb2.StreamNodeMetricsRequest(run_id="any")),
            (stub.WatchNodeStatus, node_pb2.WatchNodeStatusRequest(run_id="any")),
        ]
        for method, request in calls:
            details = refused(grpc.StatusCode.UNAUTHENTICATED, method, request)
            assert "['coordinator']" in details and repr(role) in details
    for target in ("node0", "node1"):  # nothing started anywhere
        status = daemon(running, target, "coordinator").GetNodeStatus(node_pb2.GetNodeStatusRequest(), timeout=5)
        assert not status.status.run_id.startswith("evil"), status
    still_serving(running)


def test_a_node_certificate_cannot_stop_a_running_run_and_the_coordinators_can(running: LocalCluster) -> None:
    as_coordinator = daemon(running, "node1", "coordinator")
    answer = as_coordinator.PushPlan(direct_push("live", num_steps=0), timeout=30)
    assert answer.accepted, answer.reason
    try:
        for identity in (node_identity("node1"), node_identity("node0"), "admin"):
            stop = daemon(running, "node1", identity).StopRun
            refused(grpc.StatusCode.UNAUTHENTICATED, stop, node_pb2.StopRunRequest(run_id="live"))
        status = as_coordinator.GetNodeStatus(node_pb2.GetNodeStatusRequest(), timeout=5).status
        assert (status.run_id, status.state) == ("live", node_pb2.RUN_STATE_RUNNING), status
    finally:
        stopped = as_coordinator.StopRun(node_pb2.StopRunRequest(run_id="live", reason="test"), timeout=30)
    assert stopped.state == node_pb2.RUN_STATE_CANCELLED
    status = as_coordinator.GetNodeStatus(node_pb2.GetNodeStatusRequest(), timeout=5).status
    assert (status.run_id, status.state, status.error) == ("live", node_pb2.RUN_STATE_CANCELLED, "test")


def test_a_node_certificate_speaks_only_for_its_own_node(running: LocalCluster) -> None:
    before = running.coordinator.nodes()
    as_node1 = stub(running, node_identity("node1"))
    devices = [coordinator_pb2.Device(kind="cpu")]
    failed = node_pb2.NodeStatus(node_id="node0", run_id="any", state=node_pb2.RUN_STATE_FAILED)
    calls: list[tuple[Callable[..., Any], object]] = [
        (as_node1.RegisterNode, coordinator_pb2.RegisterNodeRequest(node_id="node0", address="127.0.0.1:1", devices=devices)),
        (as_node1.RegisterNode, coordinator_pb2.RegisterNodeRequest(node_id="ghost", address="127.0.0.1:1", devices=devices)),
        (as_node1.Heartbeat, coordinator_pb2.HeartbeatRequest(node_id="node0")),
        (as_node1.Heartbeat, coordinator_pb2.HeartbeatRequest(node_id="node1", status=failed)),
    ]  # fmt: skip
    for method, request in calls:
        details = refused(grpc.StatusCode.PERMISSION_DENIED, method, request)
        assert "the caller's certificate names node 'node1'" in details, details
        assert "--node-id node1" in details
    assert running.coordinator.nodes() == before  # node0 keeps its address; no ghost
    # its own node id is accepted; a coordinator certificate is no node at all
    own = coordinator_pb2.HeartbeatRequest(node_id="node1", status=node_pb2.NodeStatus(node_id="node1"))
    assert as_node1.Heartbeat(own, timeout=5).known
    request = coordinator_pb2.RegisterNodeRequest(node_id="coordinator", address="127.0.0.1:1", devices=devices)
    refused(grpc.StatusCode.UNAUTHENTICATED, stub(running, "coordinator").RegisterNode, request)
    still_serving(running)


def test_the_coordinator_reaches_a_node_only_at_a_daemon_whose_certificate_names_it(running: LocalCluster) -> None:
    """A node registered under its own id but with another node's address: the push fails the TLS check."""
    node0 = next(n for n in running.nodes if n.config.node_id == "node0")
    pusher = RunPusher(CertPaths(running.certs, "coordinator"))
    try:
        plan = llama_plan(1, 2)
        run = coordinator_pb2.Run(run_id="spoofed", plan_version=1, num_steps=1)
        submit = coordinator_pb2.SubmitPlanRequest(plan=plan, num_steps=1)
        error = pusher.push(run, submit, plan, {"node1": [0]}, {"node1": node0.address})
        assert error.startswith(f"push to node node1 ({node0.address}) failed: UNAVAILABLE"), error
        status = pusher.stub("node0", node0.address).GetNodeStatus(node_pb2.GetNodeStatusRequest(), timeout=5)
        assert status.status.run_id != "spoofed"  # the same daemon, reached as itself: nothing started
    finally:
        pusher.close()


def test_only_an_admin_certificate_submits_or_cancels_on_the_coordinator(running: LocalCluster) -> None:
    with running.client() as client:
        run_id = client.submit(llama_plan(4, 4), steps=1)  # 4 ranks, 2 slots: stays queued
    cancel = coordinator_pb2.CancelRunRequest(run_id=run_id, reason="evil")
    submit = coordinator_pb2.SubmitPlanRequest(plan=llama_plan(), num_steps=1)
    for identity in (node_identity("node0"), "coordinator"):
        as_other = stub(running, identity)
        assert "['admin']" in refused(grpc.StatusCode.UNAUTHENTICATED, as_other.CancelRun, cancel)
        refused(grpc.StatusCode.UNAUTHENTICATED, as_other.SubmitPlan, submit)
    with running.client() as client:
        assert client.run(run_id).state == node_pb2.RUN_STATE_QUEUED
        assert client.cancel(run_id).state == node_pb2.RUN_STATE_CANCELLED


def test_a_daemon_loads_the_certificate_of_its_node_id(tmp_path: Path) -> None:
    make_certs(tmp_path, nodes=["a"])

    def config(node_id: str, identity: str = "") -> NodeConfig:
        return NodeConfig(node_id=node_id, identity=identity, coordinator="127.0.0.1:1", certs=tmp_path)

    assert NodeDaemon(config("a")).config.node_id == "a"  # node-a.pem, named a
    with pytest.raises(FileNotFoundError) as missing:
        NodeDaemon(config("b"))
    assert "node-b.pem is missing" in str(missing.value)
    assert f"`octopipe certs node {tmp_path} b" in str(missing.value)
    with pytest.raises(ValueError, match=r"name 'a', but this needs role 'node' and name 'b'.*--identity node-b"):
        NodeDaemon(config("b", identity="node-a"))
    with pytest.raises(ValueError, match=r"role 'coordinator'.*needs role 'node'"):
        NodeDaemon(config("coordinator", identity="coordinator"))
    with pytest.raises(ValueError, match="cannot name a certificate"):
        NodeDaemon(config("../a"))
    with pytest.raises(ValueError, match=r"role 'admin'.*needs role 'coordinator'"):
        Coordinator(CoordinatorConfig(certs=tmp_path, identity="admin", state_dir=tmp_path / "state"))


def test_certs_make_and_certs_node_write_one_named_certificate_per_node(tmp_path: Path) -> None:
    folder = tmp_path / "certs"
    assert main(["certs", "make", str(folder), "--nodes", "a,b", "c"]) == 0
    assert main(["certs", "node", str(folder), "d", "--hosts", "10.0.0.4"]) == 0
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    expected = {
        "coordinator": ("coordinator", "coordinator"),
        "admin": ("admin", "admin"),
        **{node_identity(n): ("node", n) for n in "abcd"},
    }
    for identity, subject in expected.items():
        paths = CertPaths(folder, identity)
        assert paths.subject() == subject
        x509.load_pem_x509_certificate(paths.read()[1]).verify_directly_issued_by(ca)
    assert not (folder / "node.pem").exists()  # no shared node certificate any more
    assert main(["certs", "node", str(tmp_path / "nowhere"), "e"]) == 2  # no CA there
    assert main(["certs", "make", str(tmp_path / "bad"), "--nodes", "a/b"]) == 2
    assert not (tmp_path / "bad").exists()


def test_nothing_from_the_network_is_unpickled() -> None:
    """The control plane speaks protobuf only; checkpoints and results load with weights_only=True."""
    import re

    root = Path(__file__).parents[2] / "packages" / "execute" / "src" / "octopipe" / "execute"
    for path in [
        *(root / "control").glob("*.py"),
        root / "runtime" / "checkpoint.py",
        root / "runtime" / "launcher.py",
    ]:
        text = path.read_text()
        assert not re.search(r"\bpickle\b|\bmarshal\b|\bdill\b", text), path
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.start() : text.find("\n", match.start())]
            assert "weights_only=True" in call, (path, call)
