"""A whole control plane on one machine: certificates, a coordinator and node daemons on loopback.

What the README's demo, the tests and the benches start: the same coordinator
and daemons as a real cluster, with daemons in this process or in their own
processes (``prefix`` runs them elsewhere, e.g. ``ip netns exec NS``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from octopipe.execute.control.client import ControlClient
from octopipe.execute.control.coordinator import Coordinator, CoordinatorConfig
from octopipe.execute.control.node import NodeConfig, NodeDaemon
from octopipe.execute.control.security import make_certs

__all__ = ["LocalCluster", "process_alive"]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process (Linux /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


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
        make_certs(self.certs, hosts=list(dict.fromkeys([*hosts, listen_host])))
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

    def add_node(self, node_id: str, slots: int = 1, **options: Any) -> NodeDaemon:
        """A node daemon in this process (its ranks are child processes)."""
        options.setdefault("pin_cores", False)
        options.setdefault("rank_timeout_s", 30.0)
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
