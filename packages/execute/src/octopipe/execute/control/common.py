"""What the coordinator and the node daemon share: servers, health, deadlines, state names, metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from octopipe.execute.control.security import AuthInterceptor, CertPaths, Claims, channel_options, server_credentials
from octopipe.execute.runs import StepTimeline
from octopipe.node.v1 import node_pb2

__all__ = [
    "RPC_DEADLINE_S",
    "TERMINAL_STATES",
    "Server",
    "Waiter",
    "start_server",
    "state_name",
    "step_metrics",
]

#: The deadline of every unary RPC the control plane makes.
RPC_DEADLINE_S = 10.0
TERMINAL_STATES = frozenset(
    {node_pb2.RUN_STATE_DONE, node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_CANCELLED},
)


def state_name(state: int) -> str:
    """``RUN_STATE_RUNNING`` -> ``running``."""
    return node_pb2.RunState.Name(state).removeprefix("RUN_STATE_").lower()  # type: ignore[arg-type]


@dataclass
class Server:
    """A started gRPC server with health checking; ``address`` is host:port as bound."""

    server: grpc.Server
    health: health.HealthServicer
    address: str

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 5)


def start_server(
    *,
    host: str,
    port: int,
    identity: CertPaths,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    allowed: dict[str, frozenset[str]],
    claims: Claims | None = None,
    max_workers: int = 32,
) -> Server:
    """Start a mutual-TLS server on host:port (0: any free port) with the services ``register`` adds.

    ``allowed`` and ``claims`` are the :class:`AuthInterceptor`'s: the roles per method, and the node ids
    a request speaks for (each must be the caller's certificate name).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="octopipe-grpc"),
        interceptors=[AuthInterceptor(allowed, claims)],
        # no SO_REUSEPORT: a second server on a port in use must fail, not share it at random
        options=[*channel_options(), ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=max_workers * 4,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(identity))
    except RuntimeError:  # grpc raises when the bind fails
        bound = 0
    if bound == 0:
        raise OSError(
            f"could not listen on {host}:{port}: the address is in use (another coordinator or daemon?) or not "
            "this machine's: choose a free port (port 0: any) or another address"
        )
    server.start()
    for name in (*service_names, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Server(server=server, health=health_servicer, address=f"{host}:{bound}")


class Waiter:
    """A condition that streams wait on: ``notify`` wakes every waiter; ``wait`` returns after at most ``timeout_s``."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._version = 0

    def notify(self) -> None:
        with self._condition:
            self._version += 1
            self._condition.notify_all()

    def wait(self, seen: int, timeout_s: float) -> int:
        """Block until the version moves past ``seen`` (or the timeout); return the current version."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while self._version == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._condition.wait(left)
            return self._version

    @property
    def version(self) -> int:
        with self._condition:
            return self._version


def step_metrics(run_id: str, timeline: StepTimeline) -> node_pb2.StepMetrics:
    """A rank's step (from the worker's events queue) as StepMetrics, times from the step's start."""
    metrics = node_pb2.StepMetrics(
        run_id=run_id,
        step=timeline.step,
        rank=timeline.rank,
        step_duration_us=(timeline.end_ns - timeline.start_ns) / 1e3,
        plan_switches=timeline.plan_switches,
        step_start_ns=timeline.start_ns,
        peak_memory_bytes=timeline.peak_held_bytes,
    )
    if timeline.loss is not None:
        metrics.loss, metrics.has_loss = timeline.loss, True
    metrics.stage_backends.extend(timeline.stage_backends)
    metrics.timeline.CopyFrom(timeline.to_proto())
    return metrics
