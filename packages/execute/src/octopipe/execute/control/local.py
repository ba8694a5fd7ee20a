"""A whole control plane on one machine: certificates, a coordinator and node daemons on loopback.

What the README's demo, the tests and the benches start: the same coordinator
and daemons as a real cluster, with daemons in this process or in their own
processes (``prefix`` runs them elsewhere, e.g. ``ip netns exec NS``). The
cluster's CA signs each node's certificate (``node-<id>``) when the node is
added, so any node id works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from octopipe.execute.control.certs import add_node_certs, make_certs
from octopipe.execute.control.client import ControlClient
from octopipe.execute.control.common import state_name
from octopipe.execute.control.coordinator import Coordinator, CoordinatorConfig
from octopipe.execute.control.node import NodeConfig, NodeDaemon
from octopipe.execute.control.security import node_identity
from octopipe.execute.runs import RunFailed, RunResult, StepTimeline
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2

__all__ = ["LocalCluster", "process_alive", "result_from_metrics"]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process (Linux /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def result_from_metrics(
    plan: plan_pb2.Plan, metrics: Sequence[node_pb2.StepMetrics], *, wall_s: float = 0.0
) -> RunResult:
    """A RunResult (losses of the last stage's rank, per-rank timelines on the monotonic clock) from StepMetrics."""
    last_rank = plan.stages[-1].rank
    ordered = sorted(metrics, key=lambda m: (m.rank, m.step))
    result = RunResult(losses=[m.loss for m in ordered if m.rank == last_rank], wall_s=wall_s)
    for item in ordered:
        step = StepTimeline.from_proto(
            item.timeline, start_ns=int(item.step_start_ns), duration_us=item.step_duration_us
        )
        result.timelines.setdefault(int(item.rank), []).append(step)
        for note in item.stage_backends:  # "stage N: ..." from each rank's first step
            stage, _, _ = note.partition(":")
            if stage.startswith("stage ") and stage[6:].isdigit():
                result.stage_backends[int(stage[6:])] = note
    return result


class LocalCluster:
    """Start with ``with LocalCluster(root) as cluster:``; everything it started stops on exit."""

    def __init__(
        self,
        root: Path,
        *,
        listen_host: str = "127.0.0.1",
        hosts: Sequence[str] = ("127.0.0.1", "localhost"),
        heartbeat_interval_s: float = 0.25,
        heartbeat_timeout_s: float = 1.5,
        **coordinator_options: Any,
    ) -> None:
        self.root = root
        self.hosts = list(dict.fromkeys([*hosts, listen_host]))
        make_certs(self.certs, hosts=self.hosts)
        self.config = CoordinatorConfig(
            certs=self.certs,
            state_dir=root / "coordinator",
            listen_host=listen_host,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            **coordinator_options,
        )
        self.coordinator = Coordinator(self.config).start()
        self.nodes: list[NodeDaemon] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def client(self, identity: str = "admin") -> ControlClient:
        return ControlClient(self.coordinator.address, self.certs, identity)

    def node_certs(self, node_id: str) -> str:
        """Node ``node_id``'s identity in ``certs``, its certificate made (for ``hosts``) unless it exists."""
        identity = node_identity(node_id)
        if not (self.certs / f"{identity}.pem").is_file():
            add_node_certs(self.certs, [node_id], hosts=self.hosts)
        return identity

    def add_node(self, node_id: str, slots: int = 1, **options: Any) -> NodeDaemon:
        """A node daemon in this process (its ranks are child processes)."""
        options.setdefault("pin_cores", False)
        options.setdefault("rank_timeout_s", 30.0)
        self.node_certs(node_id)
        config = NodeConfig(
            node_id=node_id,
            coordinator=self.coordinator.address,
            certs=self.certs,
            slots=slots,
            work_dir=self.root / node_id,
            **options,
        )
        node = NodeDaemon(config).start()
        self.nodes.append(node)
        return node

    def node_process(
        self,
        node_id: str,
        *,
        slots: int = 1,
        prefix: Sequence[str] = (),
        listen: str = "127.0.0.1:0",
        fence_after_s: float = 4.0,
        timeout_s: float = 60.0,
    ) -> subprocess.Popen[bytes]:
        """A node daemon in its own process (``octopipe node``); returns once it has registered."""
        self.node_certs(node_id)
        log = open(self.root / f"{node_id}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        command = [
            *prefix, sys.executable, "-m", "octopipe.execute", "--log-format", "json", "node",
            "--coordinator", self.coordinator.address, "--certs", str(self.certs), "--node-id", node_id,
            "--slots", str(slots), "--listen", listen, "--work-dir", str(self.root / node_id), "--no-pin",
            "--rank-timeout", "30", "--fence-after", str(fence_after_s),
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        deadline = time.monotonic() + timeout_s
        while not any(n == node_id and alive for n, _, alive in self.coordinator.nodes()):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                text = (self.root / f"{node_id}.log").read_text(errors="replace")
                raise RuntimeError(f"node {node_id} did not register within {timeout_s:.0f} s: {text[-2000:]}")
            time.sleep(0.1)
        return process

    def run_plans(
        self,
        plans: Sequence[plan_pb2.Plan],
        *,
        steps: int,
        seed: int = 0,
        timeout_s: float = 600.0,
        compile: str = "",
    ) -> list[RunResult]:
        """Submit each plan as a run, one after the other; each run's losses and timelines as a RunResult.

        What the local launcher returns, rebuilt from the metric streams (no gradients or weights);
        ``compile`` says how the stage graphs run (``RunOptions.compile``; empty: eager).
        """
        results = []
        with self.client() as client:
            for plan in plans:
                started = time.monotonic()
                run_id = client.submit(plan, steps=steps, seed=seed, compile=compile)
                run = client.wait(run_id, timeout_s=timeout_s)
                if run.state != node_pb2.RUN_STATE_DONE:
                    raise RunFailed(f"run {run_id} ({plan.name}) {state_name(run.state)}: {run.error}")
                metrics = client.metrics(run_id, timeout_s=60)
                results.append(result_from_metrics(plan, metrics, wall_s=time.monotonic() - started))
        return results

    def restart_coordinator(self) -> Coordinator:
        """Stop the coordinator and start a new one on the same state folder and address (the daemons
        re-register when their heartbeats are refused); the new one."""
        port = int(self.coordinator.address.rsplit(":", 1)[1])
        self.coordinator.stop()
        self.config = dataclasses.replace(self.config, listen_port=port)
        self.coordinator = Coordinator(self.config).start()
        return self.coordinator

    def rank_pids(self, node_id: str) -> list[int]:
        """The process ids of every rank a node started (each rank writes ``rank<r>.pid``)."""
        return [int(p.read_text()) for p in (self.root / node_id).glob("*/rank*.pid")]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        self.coordinator.stop()
        for log in self._logs:
            log.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
