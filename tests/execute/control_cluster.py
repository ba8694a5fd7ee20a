"""A real control-plane cluster for tests: certificates, a coordinator and node daemons on loopback."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from octopipe.execute.control import (
    ControlClient,
    Coordinator,
    CoordinatorConfig,
    NodeConfig,
    NodeDaemon,
    make_certs,
)
from octopipe.execute.runtime import build_model, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b


def llama_plan(ranks: int = 2, m: int = 4, schedule=one_f_one_b) -> plan_pb2.Plan:  # type: ignore[no-untyped-def]
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2 * m)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan: plan_pb2.Plan = schedule(ranks, m, layer_names=equal_partition(names, ranks))
    plan.model.CopyFrom(reference)
    return plan


@dataclass
class Cluster:
    root: Path
    coordinator: Coordinator
    nodes: list[NodeDaemon] = field(default_factory=list)

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    def client(self, identity: str = "admin") -> ControlClient:
        return ControlClient(self.coordinator.address, self.certs, identity)

    def add_node(self, node_id: str, slots: int = 1, **options: object) -> NodeDaemon:
        config = NodeConfig(
            node_id=node_id,
            coordinator=self.coordinator.address,
            certs=self.certs,
            slots=slots,
            work_dir=self.root / node_id,
            pin_cores=False,
            rank_timeout_s=30.0,
            **options,  # type: ignore[arg-type]
        )
        node = NodeDaemon(config).start()
        self.nodes.append(node)
        return node


def coordinator_config(root: Path, **options: object) -> CoordinatorConfig:
    return CoordinatorConfig(
        certs=root / "certs",
        state_dir=root / "coordinator",
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=1.5,
        **options,  # type: ignore[arg-type]
    )


@contextlib.contextmanager
def cluster(root: Path, nodes: int = 2, **options: object) -> Iterator[Cluster]:
    make_certs(root / "certs")
    coordinator = Coordinator(coordinator_config(root, **options)).start()
    running = Cluster(root=root, coordinator=coordinator)
    try:
        for index in range(nodes):
            running.add_node(f"node{index}")
        yield running
    finally:
        for node in running.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        coordinator.stop()


def node_process(
    running: Cluster,
    node_id: str,
    *,
    slots: int = 1,
    prefix: Sequence[str] = (),
    listen: str = "127.0.0.1:0",
    coordinator: str | None = None,
    advertise: str = "",
) -> subprocess.Popen[bytes]:
    """A node daemon in its own process (``prefix``: e.g. ``ip netns exec NS``); waits until it registered."""
    log = open(running.root / f"{node_id}.log", "wb")  # noqa: SIM115 - the process owns it
    command = [
        *prefix, sys.executable, "-m", "octopipe.execute", "--log-format", "json", "node",
        "--coordinator", coordinator or running.coordinator.address, "--certs", str(running.certs),
        "--node-id", node_id, "--slots", str(slots), "--listen", listen, "--work-dir", str(running.root / node_id),
        "--no-pin", "--rank-timeout", "30", "--fence-after", "4",
    ]  # fmt: skip
    if advertise:
        command += ["--advertise", advertise]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not any(n == node_id and alive for n, _, alive in running.coordinator.nodes()):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"node {node_id} did not register: {(running.root / f'{node_id}.log').read_text()}")
        time.sleep(0.1)
    return process


def rank_pids(running: Cluster, node_id: str) -> list[int]:
    return [int(p.read_text()) for p in (running.root / node_id).glob("*/rank*.pid")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
