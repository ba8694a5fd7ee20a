"""A real control-plane cluster for tests: certificates, a coordinator and node daemons on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
