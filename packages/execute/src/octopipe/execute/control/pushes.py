"""Pushing a run's plan to its nodes, following their metric streams, and stopping them.

The node of global rank 0 is pushed first: it opens the run's rendezvous store
and answers with its port, which the other pushes carry. Every push has a
fresh nonce and a deadline; a NACK or an unreachable node fails the start, and
the nodes that did ACK are told to stop.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import grpc
import structlog

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.control.common import RPC_DEADLINE_S
from octopipe.execute.control.security import CertPaths, node_server_name, secure_channel
from octopipe.execute.devices import backend_for
from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.plan.v1 import plan_pb2

__all__ = ["RunPusher"]

MetricsSink = Callable[[str, node_pb2.StepMetrics], None]


class RunPusher:
    """One channel per node (id, address); pushes, stops and metric streams over them.

    Each channel expects the daemon's certificate to name the node (``security.node_server_name``):
    a node that registered another node's address reaches nothing."""

    def __init__(self, identity: CertPaths, on_metrics: MetricsSink | None = None) -> None:
        self._identity = identity
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        self._lock = threading.Lock()
        self.on_metrics = on_metrics
        self._log = structlog.get_logger("octopipe.coordinator.push")

    def stub(self, node_id: str, address: str) -> node_pb2_grpc.NodeServiceStub:
        """The daemon of ``node_id`` at ``address`` (its certificate must name ``node_id``)."""
        key = (node_id, address)
        with self._lock:
            if key not in self._channels:
                self._channels[key] = secure_channel(address, self._identity, server_name=node_server_name(node_id))
            return node_pb2_grpc.NodeServiceStub(self._channels[key])

    def forget(self, node_id: str) -> None:
        """Close the channels to ``node_id``: it (re-)registered, and a channel kept from before (a daemon that
        was restarted, a link that was cut) may be waiting out a reconnect backoff a push would time out on."""
        with self._lock:
            for key in [k for k in self._channels if k[0] == node_id]:
                self._channels.pop(key).close()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def push(
        self,
        run: coordinator_pb2.Run,
        submit: coordinator_pb2.SubmitPlanRequest,
        plan: plan_pb2.Plan,
        placement: dict[str, list[int]],
        addresses: dict[str, str],
    ) -> str:
        """Push to every node of ``placement``; return an error (empty when every node ACKed)."""
        world = mesh_spec(plan).world_size
        first = next(node for node, ranks in placement.items() if 0 in ranks)
        order = [first, *(node for node in placement if node != first)]
        host = addresses[first].rsplit(":", 1)[0]
        port = 0
        accepted: list[str] = []
        for node_id in order:
            request = node_pb2.PushPlanRequest(
                run_id=run.run_id,
                version=run.plan_version,
                nonce=uuid.uuid4().hex,
                plan=plan,
                assignment=node_pb2.RankAssignment(
                    ranks=placement[node_id],
                    world_size=world,
                    rendezvous_host=host,
                    rendezvous_port=port,
                    backend=backend_for(submit.device),
                ),
                num_steps=run.num_steps,
                start_step=run.last_checkpoint_step if run.resumes else 0,
                checkpoint_dir=run.checkpoint_dir,
                checkpoint_every=submit.checkpoint_every,
                resume=bool(run.resumes and run.last_checkpoint_step),
                seed=submit.seed,
                adaptive=submit.adapt,
                checkpoint_async=submit.checkpoint_async,
                checkpoint_keep=submit.checkpoint_keep,
                compile=submit.compile,
            )
            sent_at = time.perf_counter()
            try:
                response = self.stub(node_id, addresses[node_id]).PushPlan(request, timeout=RPC_DEADLINE_S)
            except grpc.RpcError as exc:
                error = f"push to node {node_id} ({addresses[node_id]}) failed: {exc.code().name}: {exc.details()}"
                self.stop_async(run.run_id, {n: addresses[n] for n in accepted}, error)
                return error
            if not response.accepted:
                self.stop_async(run.run_id, {n: addresses[n] for n in accepted}, response.reason)
                return f"node {node_id} refused the plan: {response.reason}"
            accepted.append(node_id)
            if node_id == first:
                port = response.rendezvous_port
            self._log.info(
                "pushed",
                run=run.run_id,
                node=node_id,
                version=run.plan_version,
                ranks=placement[node_id],
                latency_ms=round((time.perf_counter() - sent_at) * 1e3, 3),
            )
        for node_id in order:
            self.follow(run.run_id, node_id, addresses[node_id])
        return ""

    def switch(
        self, run: coordinator_pb2.Run, plan: plan_pb2.Plan, placement: dict[str, list[int]], addresses: dict[str, str]
    ) -> str:
        """Push a newer plan to a running run's nodes (the rank-0 node publishes it); return an error or ''."""
        first = next(node for node, ranks in placement.items() if 0 in ranks)
        nonce = uuid.uuid4().hex
        for node_id in [first, *(node for node in placement if node != first)]:
            request = node_pb2.PushPlanRequest(
                run_id=run.run_id, version=run.plan_version, nonce=nonce, plan=plan, switch_plan=True
            )
            try:
                response = self.stub(node_id, addresses[node_id]).PushPlan(request, timeout=RPC_DEADLINE_S)
            except grpc.RpcError as exc:
                return f"plan switch to node {node_id} failed: {exc.code().name}: {exc.details()}"
            if not response.accepted:
                return f"node {node_id} refused the plan switch: {response.reason}"
        self._log.info("plan_switched", run=run.run_id, version=run.plan_version, schedule=plan.labels.get("schedule"))
        return ""

    def follow(self, run_id: str, node_id: str, address: str) -> None:
        """Keep the run's metrics from ``node_id``'s stream, on a thread, until the stream ends."""

        def follow() -> None:
            try:
                for response in self.stub(node_id, address).StreamNodeMetrics(
                    node_pb2.StreamNodeMetricsRequest(run_id=run_id), timeout=24 * 3600
                ):
                    if self.on_metrics is not None:
                        self.on_metrics(run_id, response.metrics)
            except grpc.RpcError as exc:  # the node went away: heartbeats report that
                self._log.info("metrics_stream_ended", run=run_id, node=node_id, code=exc.code().name)

        threading.Thread(target=follow, name=f"octopipe-metrics-{node_id}", daemon=True).start()

    def stop_async(self, run_id: str, nodes: dict[str, str], reason: str) -> None:
        """Tell nodes (id -> address) to stop a run, without blocking the caller (each call has a deadline)."""

        def stop(node_id: str, address: str) -> None:
            try:
                self.stub(node_id, address).StopRun(
                    node_pb2.StopRunRequest(run_id=run_id, reason=reason), timeout=RPC_DEADLINE_S
                )
            except grpc.RpcError as exc:
                self._log.warning("stop_failed", run=run_id, node=node_id, address=address, code=exc.code().name)

        for node_id, address in nodes.items():
            threading.Thread(target=stop, args=(node_id, address), name="octopipe-stop", daemon=True).start()
