"""Load on the coordinator: 64 simulated node daemons (no torch) on loopback, plans pushed and metrics streamed.

The coordinator runs in its own process (``octopipe coordinator``, JSON logs), so its memory is its own.
Simulated daemons (all in this process) register, heartbeat, ACK pushes and stream one StepMetrics per
rank per step; the bench keeps every node busy with 8-rank runs, follows each run's metric stream
through the coordinator and counts what arrives against what the daemons sent.

Reports: p50/p99 push-to-ACK latency (the coordinator's PushPlan round trip, from its ``pushed``
events), coordinator RSS at the start and end, runs finished, metrics sent / received (lost = sent -
received). Run: .venv/bin/python bench/control_load.py [--seconds 120] [--nodes 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.control import ControlClient, make_certs
from octopipe.execute.control.common import start_server
from octopipe.execute.control.security import CertPaths, node_identity, secure_channel
from octopipe.execute.processes import free_port
from octopipe.execute.runtime import workload_reference
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.tune import equal_partition, one_f_one_b

RESULTS = Path(__file__).parent / "results" / "control_load.json"


class SimulatedNode(node_pb2_grpc.NodeServiceServicer):
    """A node daemon's protocol without ranks: ACK, then one StepMetrics per rank per step."""

    def __init__(self, node_id: str, certs: Path, coordinator: str, step_s: float) -> None:
        self.node_id, self.step_s = node_id, step_s
        self.identity = CertPaths(certs, node_identity(node_id))
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.run: node_pb2.PushPlanRequest | None = None
        self.state = node_pb2.RUN_STATE_UNSPECIFIED
        self.metrics: list[node_pb2.StepMetrics] = []
        self.sent = 0
        self.done_steps = 0
        self.stopping = threading.Event()
        self.server = start_server(
            host="127.0.0.1",
            port=0,
            identity=self.identity,
            register=lambda s: node_pb2_grpc.add_NodeServiceServicer_to_server(self, s),
            service_names=["octopipe.node.v1.NodeService"],
            allowed={},
            max_workers=4,
        )
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(secure_channel(coordinator, self.identity))
        devices = [coordinator_pb2.Device(kind="cpu", index=0)]
        self.stub.RegisterNode(
            coordinator_pb2.RegisterNodeRequest(node_id=node_id, address=self.server.address, devices=devices),
            timeout=10,
        )
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _status(self) -> node_pb2.NodeStatus:
        with self.lock:
            status = node_pb2.NodeStatus(node_id=self.node_id, state=self.state, completed_steps=self.done_steps)
            if self.run is not None:
                status.run_id, status.plan_version = self.run.run_id, self.run.version
            return status

    def _heartbeat(self) -> None:
        while not self.stopping.wait(0.5):
            with contextlib.suppress(grpc.RpcError):
                request = coordinator_pb2.HeartbeatRequest(node_id=self.node_id, status=self._status())
                self.stub.Heartbeat(request, timeout=5)

    def PushPlan(self, request: node_pb2.PushPlanRequest, context: Any) -> node_pb2.PushPlanResponse:
        with self.lock:
            self.run, self.state, self.done_steps, self.metrics = request, node_pb2.RUN_STATE_RUNNING, 0, []
        threading.Thread(target=self._steps, args=(request,), daemon=True).start()
        return node_pb2.PushPlanResponse(accepted=True, version=request.version, nonce=request.nonce, rendezvous_port=1)

    def _steps(self, request: node_pb2.PushPlanRequest) -> None:
        for step in range(request.num_steps):
            time.sleep(self.step_s)
            with self.lock:
                for rank in request.assignment.ranks:
                    metrics = node_pb2.StepMetrics(run_id=request.run_id, step=step, rank=rank, loss=1.0 / (step + 1))
                    metrics.timeline.records.add(stream="compute", start_us=0.0, end_us=self.step_s * 1e6)
                    self.metrics.append(metrics)
                    self.sent += 1
                self.done_steps = step + 1
                self.changed.notify_all()
        with self.lock:
            self.state = node_pb2.RUN_STATE_DONE
            self.changed.notify_all()

    def StopRun(self, request: node_pb2.StopRunRequest, context: Any) -> node_pb2.StopRunResponse:
        return node_pb2.StopRunResponse(state=node_pb2.RUN_STATE_CANCELLED)

    def GetNodeStatus(self, request: Any, context: Any) -> node_pb2.GetNodeStatusResponse:
        return node_pb2.GetNodeStatusResponse(status=self._status())

    def WatchNodeStatus(self, request: Any, context: Any) -> Any:
        yield node_pb2.WatchNodeStatusResponse(status=self._status())

    def StreamNodeMetrics(self, request: node_pb2.StreamNodeMetricsRequest, context: Any) -> Any:
        sent = 0
        while context.is_active():
            with self.lock:
                if self.run is None or self.run.run_id != request.run_id:
                    return
                fresh, sent = self.metrics[sent:], len(self.metrics)
                done = self.state == node_pb2.RUN_STATE_DONE
                if not fresh and not done:
                    self.changed.wait(1.0)
                    continue
            for metrics in fresh:
                yield node_pb2.StreamNodeMetricsResponse(metrics=metrics)
            if done and not fresh:
                return


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--world", type=int, default=8, help="ranks per run")
    parser.add_argument("--steps", type=int, default=20, help="steps per run")
    parser.add_argument("--step-s", type=float, default=0.1, help="simulated step time")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="octopipe-load-"))
    make_certs(root / "certs", nodes=[f"sim{i:02d}" for i in range(args.nodes)])
    port = free_port()
    log = open(root / "coordinator.log", "w")  # noqa: SIM115
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "octopipe.execute", "--log-format", "json", "coordinator", "--listen",
         f"127.0.0.1:{port}", "--certs", str(root / "certs"), "--state-dir", str(root / "state"),
         "--heartbeat-timeout", "5"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "coordinator_started" not in (root / "coordinator.log").read_text():
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "coordinator.log").read_text())
            time.sleep(0.2)
        rss_start = _rss_bytes(coordinator.pid)
        nodes = [SimulatedNode(f"sim{i:02d}", root / "certs", address, args.step_s) for i in range(args.nodes)]
        names = [f"layers.{i}" for i in range(2 * args.world)]
        plan = one_f_one_b(args.world, 2 * args.world, layer_names=equal_partition(names, args.world))
        plan.model.CopyFrom(workload_reference("llama-8", tiny=True))
        received: dict[str, int] = {}
        followers: list[threading.Thread] = []
        client = ControlClient(address, root / "certs")

        def follow(run_id: str) -> None:
            received[run_id] = len(client.metrics(run_id, timeout_s=args.seconds + 120))

        started = time.monotonic()
        submitted: list[str] = []
        rss_samples = []
        while time.monotonic() - started < args.seconds:
            active = [r for r in client.runs() if r.state not in (node_pb2.RUN_STATE_DONE, node_pb2.RUN_STATE_FAILED)]
            for _ in range(args.nodes // args.world - len(active)):
                run_id = client.submit(plan, steps=args.steps)
                submitted.append(run_id)
                thread = threading.Thread(target=follow, args=(run_id,), daemon=True)
                thread.start()
                followers.append(thread)
            rss_samples.append(_rss_bytes(coordinator.pid))
            time.sleep(1.0)
        for run_id in submitted:
            client.wait(run_id, timeout_s=120)
        for thread in followers:
            thread.join(timeout=60)
        rss_end = _rss_bytes(coordinator.pid)
        runs = {r.run_id: r for r in client.runs()}
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
        log.close()
    latencies = [
        event["latency_ms"]
        for line in (root / "coordinator.log").read_text().splitlines()
        if line.startswith("{") and (event := json.loads(line)).get("event") == "pushed"
    ]
    sent = sum(node.sent for node in nodes)
    got = sum(received.values())
    done = sum(1 for r in runs.values() if r.state == node_pb2.RUN_STATE_DONE)
    quantiles = statistics.quantiles(latencies, n=100)
    result = {
        "nodes": args.nodes,
        "seconds": args.seconds,
        "runs_submitted": len(submitted),
        "runs_done": done,
        "pushes": len(latencies),
        "push_to_ack_ms": {"p50": quantiles[49], "p99": quantiles[98], "max": max(latencies)},
        "coordinator_rss_mb": {"start": rss_start / 2**20, "end": rss_end / 2**20, "max": max(rss_samples) / 2**20},
        "metrics_sent": sent,
        "metrics_received": got,
        "metrics_lost": sent - got,
    }
    print(
        f"{'nodes':>6} {'runs':>6} {'pushes':>7} {'ack p50 ms':>11} {'ack p99 ms':>11} {'rss MB start/end':>17} {'sent':>7} {'lost':>5}"
    )
    print(
        f"{args.nodes:>6} {done:>6} {len(latencies):>7} {quantiles[49]:>11.2f} {quantiles[98]:>11.2f} "
        f"{rss_start / 2**20:>8.1f}/{rss_end / 2**20:<8.1f} {sent:>7} {sent - got:>5}"
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
