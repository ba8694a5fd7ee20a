"""The node daemon: one per machine; runs the rank processes of the plans a coordinator pushes.

A daemon registers with its coordinator, then heartbeats. On a push it checks
the plan (structure, model source allowed here, enough slots, not busy with
another run) and ACKs or NACKs with a reason; a re-push with the same nonce
gets the same answer. The node of global rank 0 hosts the run's rendezvous
store (a TCPStore on a free port, sent back in the ACK). Rank processes report
every step through a queue; the daemon streams those metrics, tracks the run's
state and, when a rank fails or the run is stopped, raises the run's abort
flag so every rank everywhere leaves its waits, then kills what is left after
a grace period. A daemon that cannot reach its coordinator for
``fence_after_s`` stops its ranks itself. It serves and registers with its
node's own certificate (``node-<node id>``) and takes calls only from the
coordinator's.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.control.common import (
    RPC_DEADLINE_S,
    TERMINAL_STATES,
    Server,
    Waiter,
    start_server,
    state_name,
    step_metrics,
)
from octopipe.execute.control.ranks import KeeperError, StoreKeeper, start_rank
from octopipe.execute.control.security import (
    COORDINATOR,
    NODE,
    CertPaths,
    node_identity,
    require_identity,
    secure_channel,
)
from octopipe.execute.control.submission import run_id_problem
from octopipe.execute.devices import Gpu, backend_device, backend_problem, probe_gpus
from octopipe.execute.processes import free_port
from octopipe.execute.runs import WORKLOAD_SOURCE, RunOptions, WorkerConfig, precision_problem, same_layout
from octopipe.ir import PlanError, mesh_spec
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.simulate import verify_plan

__all__ = ["NodeConfig", "NodeDaemon"]

_SERVICE = "octopipe.node.v1.NodeService"
#: only the coordinator's certificate drives a daemon (admin and node certificates are refused)
_COORDINATOR_ONLY = frozenset({COORDINATOR})
_ALLOWED = {
    f"/{_SERVICE}/{method}": _COORDINATOR_ONLY
    for method in ("PushPlan", "StopRun", "GetNodeStatus", "WatchNodeStatus", "StreamNodeMetrics")
}
_MAX_METRICS = 20_000
#: registration retries: the first wait, doubling up to the last
_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
_NONCE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: how long the daemon waits for its store keeper to open the store or carry out a command
_KEEPER_WAIT_S = 15.0


@dataclass(kw_only=True)
class NodeConfig:
    node_id: str
    coordinator: str
    certs: Path
    #: the certificate in ``certs`` (role node, common name ``node_id``); "" is ``node-<node_id>``
    identity: str = ""
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    #: the address others reach this node at (default: listen_host)
    advertise_host: str = ""
    #: rank processes this node runs at most
    slots: int = 2
    work_dir: Path = field(default_factory=lambda: Path("octopipe-node"))
    #: model sources a pushed plan may name (``package.module:function``); the standard workloads always
    allowed_model_sources: tuple[str, ...] = ()
    rank_timeout_s: float = 60.0
    stop_grace_s: float = 3.0
    fence_after_s: float = 6.0
    pin_cores: bool = True
    #: the GPUs this node offers; None: what ``nvidia-smi`` lists (``devices.probe_gpus``)
    gpus: tuple[Gpu, ...] | None = None


@dataclass
class _Run:
    run_id: str
    version: int
    nonce: str
    request: node_pb2.PushPlanRequest
    folder: Path
    processes: list[Any] = field(default_factory=list)
    events: Any = None
    #: the child holding (on the node of global rank 0) or joining the run's rendezvous store
    keeper: StoreKeeper | None = None
    hosts_store: bool = False
    state: int = node_pb2.RUN_STATE_STARTING
    error: str = ""
    steps_done: dict[int, int] = field(default_factory=dict)
    metrics: collections.deque[node_pb2.StepMetrics] = field(
        default_factory=lambda: collections.deque(maxlen=_MAX_METRICS)
    )
    metrics_seen: int = 0
    response: node_pb2.PushPlanResponse | None = None
    switches: int = 0


class NodeDaemon(node_pb2_grpc.NodeServiceServicer):
    """Start with ``start()``; ``stop()`` stops every rank and the server."""

    def __init__(self, config: NodeConfig) -> None:
        if config.slots < 1:
            raise ValueError(f"a node needs at least 1 slot (--slots), got {config.slots}")
        self.config = config
        self._identity = CertPaths(config.certs, config.identity or node_identity(config.node_id))
        require_identity(self._identity, NODE, config.node_id)
        self._lock = threading.RLock()
        self._changed = Waiter()
        self._run: _Run | None = None
        self._keeper: StoreKeeper | None = None  # the latest run's (kept until the next run or stop)
        self._stopping = threading.Event()
        self._server: Server | None = None
        self._threads: list[threading.Thread] = []
        self._log = structlog.get_logger("octopipe.node").bind(node=config.node_id)
        self._context = multiprocessing.get_context("spawn")
        self.last_contact = time.monotonic()
        self.heartbeat_interval_s = 0.5
        self._registered = False
        self._backoff_s = _FIRST_BACKOFF_S
        self.gpus: tuple[Gpu, ...] = tuple(probe_gpus()) if config.gpus is None else config.gpus

    # -- life cycle -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the daemon is not started")
        port = self._server.address.rsplit(":", 1)[1]
        return f"{self.config.advertise_host or self.config.listen_host}:{port}"

    def start(self) -> NodeDaemon:
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        self._server = start_server(
            host=self.config.listen_host,
            port=self.config.listen_port,
            identity=self._identity,
            register=lambda server: node_pb2_grpc.add_NodeServiceServicer_to_server(self, server),
            service_names=[_SERVICE],
            allowed=_ALLOWED,
        )
        self._channel = secure_channel(self.config.coordinator, self._identity)
        self._coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._try_register()  # until it takes, the heartbeat thread retries with backoff
        thread = threading.Thread(target=self._heartbeat_loop, name="octopipe-heartbeat", daemon=True)
        thread.start()
        self._threads.append(thread)
        self._log.info("node_started", address=self.address, slots=self.config.slots)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._stop_run("the node daemon is shutting down", node_pb2.RUN_STATE_CANCELLED)
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.close()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._server is not None:
            self._server.stop()
        self._channel.close()

    def wait(self) -> None:
        """Block until ``stop()`` (for the CLI)."""
        while not self._stopping.wait(1.0):
            pass

    def _register(self) -> None:
        devices = [coordinator_pb2.Device(kind="cpu", index=i, name="cpu") for i in range(self.config.slots)]
        devices += [
            coordinator_pb2.Device(kind="cuda", index=g.index, name=g.name, memory_bytes=g.memory_bytes)
            for g in self.gpus
        ]
        request = coordinator_pb2.RegisterNodeRequest(
            node_id=self.config.node_id, address=self.address, devices=devices
        )
        response = self._coordinator.RegisterNode(request, timeout=RPC_DEADLINE_S)
        self.heartbeat_interval_s = response.heartbeat_interval_ms / 1e3 or 0.5
        self.last_contact = time.monotonic()
        self._registered = True

    def _try_register(self) -> bool:
        """Register; False (and a warning) when the coordinator cannot take it yet, which a later try may
        change (not up, or another live daemon holds this id). A refusal no retry changes raises ValueError."""
        try:
            self._register()
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                raise ValueError(f"the coordinator refused node {self.config.node_id}: {details}") from None
            hint = (
                details
                if code == grpc.StatusCode.ALREADY_EXISTS
                else "unreachable (not started yet, or its certificate is not signed by this folder's CA)"
            )
            self._log.warning(
                "registration_retry", coordinator=self.config.coordinator, reason=hint, retry_in_s=self._backoff_s
            )
            return False
        self._log.info("node_registered", coordinator=self.config.coordinator)
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_interval_s if self._registered else self._backoff_s):
            if not self._registered:
                if not self._try_register():
                    self._backoff_s = min(self._backoff_s * 2, _MAX_BACKOFF_S)
                    continue
                self._backoff_s = _FIRST_BACKOFF_S
            try:
                response = self._coordinator.Heartbeat(
                    coordinator_pb2.HeartbeatRequest(node_id=self.config.node_id, status=self._status()),
                    timeout=max(self.heartbeat_interval_s, 1.0),
                )
                self.last_contact = time.monotonic()
                if not response.known:  # the coordinator restarted, or declared this node lost
                    self._registered = False
                    self._try_register()
            except grpc.RpcError as exc:
                silent = time.monotonic() - self.last_contact
                if silent > self.config.fence_after_s and self._active():
                    self._log.warning("coordinator_lost", silent_s=round(silent, 2), code=str(exc.code()))
                    self._stop_run(
                        f"node {self.config.node_id} lost contact with the coordinator for {silent:.1f} s",
                        node_pb2.RUN_STATE_FAILED,
                    )

    # -- status -----------------------------------------------------------------------------------
    def _active(self) -> bool:
        with self._lock:
            return self._run is not None and self._run.state not in TERMINAL_STATES

    def _status(self) -> node_pb2.NodeStatus:
        with self._lock:
            status = node_pb2.NodeStatus(node_id=self.config.node_id)
            status.observed_at.GetCurrentTime()
            run = self._run
            if run is not None:
                status.run_id, status.plan_version = run.run_id, run.version
                status.state = run.state  # type: ignore[assignment]
                status.error = run.error
                status.completed_steps = min(run.steps_done.values(), default=run.request.start_step)
            return status

    def _set_state(self, run: _Run, state: int, error: str = "") -> None:
        with self._lock:
            if run.state in TERMINAL_STATES:
                return
            run.state = state
            if error and not run.error:
                run.error = error
        self._log.info("run_state", run=run.run_id, state=state_name(state), error=error or None)
        self._changed.notify()

    # -- RPCs -------------------------------------------------------------------------------------
    def PushPlan(self, request: node_pb2.PushPlanRequest, context: grpc.ServicerContext) -> node_pb2.PushPlanResponse:
        if request.switch_plan:
            return self._switch(request)
        with self._lock:
            current = self._run
            if (
                current is not None
                and current.response is not None
                and (current.run_id, current.nonce) == (request.run_id, request.nonce)
            ):
                return current.response
            reason = self._refusal(request, current)
            if reason:
                self._log.info("push_refused", run=request.run_id, version=request.version, reason=reason)
                return node_pb2.PushPlanResponse(
                    accepted=False, reason=reason, version=request.version, nonce=request.nonce
                )
            run = _Run(
                run_id=request.run_id,
                version=request.version,
                nonce=request.nonce,
                request=request,
                folder=self.config.work_dir / f"{request.run_id}-v{request.version}-{request.nonce[:8]}",
            )
            try:
                port = self._launch(run)
            except Exception as exc:  # a failure to start is a NACK, not a crash
                self._kill(run)
                return node_pb2.PushPlanResponse(
                    accepted=False, reason=f"could not start ranks: {exc}", version=request.version, nonce=request.nonce
                )
            run.response = node_pb2.PushPlanResponse(
                accepted=True, version=request.version, nonce=request.nonce, rendezvous_port=port
            )
            self._run = run
        self._set_state(run, node_pb2.RUN_STATE_RUNNING)
        monitor = threading.Thread(target=self._monitor, args=(run,), name=f"octopipe-run-{run.run_id}", daemon=True)
        monitor.start()
        return run.response

    def _switch(self, request: node_pb2.PushPlanRequest) -> node_pb2.PushPlanResponse:
        """A newer plan for the running run: the store's host publishes it; ranks take it at a step boundary."""

        def answer(reason: str = "") -> node_pb2.PushPlanResponse:
            return node_pb2.PushPlanResponse(
                accepted=not reason, reason=reason, version=request.version, nonce=request.nonce
            )

        with self._lock:
            run = self._run
            if run is None or run.run_id != request.run_id or run.state in TERMINAL_STATES:
                return answer(f"run {request.run_id} is not running on node {self.config.node_id}: nothing to switch")
            if (run.version, run.nonce) == (request.version, request.nonce):
                return answer()
            if request.version <= run.version:
                return answer(f"version {request.version} is not newer than the running version {run.version}")
            if not run.request.adaptive:
                return answer("the run was not started adaptive: submit it with adapt to switch plans while it runs")
            try:
                verify_plan(request.plan)  # the same verification as every launch path
            except PlanError as exc:
                return answer(f"invalid plan: {exc}")
            problem = same_layout(run.request.plan, request.plan)
            if problem:
                return answer(f"a running plan can change only its schedule, but {problem}")
            if run.hosts_store and run.keeper is not None:
                try:
                    run.keeper.publish(run.switches + 1, request.plan.SerializeToString(), _KEEPER_WAIT_S)
                except KeeperError as exc:
                    return answer(f"the plan could not be published: {exc}")
                run.switches += 1
            run.version, run.nonce = request.version, request.nonce
            run.request.plan.CopyFrom(request.plan)
        self._log.info("plan_switch", run=run.run_id, version=request.version, published=run.hosts_store)
        self._changed.notify()
        return answer()

    def _refusal(self, request: node_pb2.PushPlanRequest, current: _Run | None) -> str:
        if run_id_problem(request.run_id):
            return run_id_problem(request.run_id)
        if not _NONCE.fullmatch(request.nonce):  # it names the run's work folder too
            return "a push's nonce must be 1-64 letters, digits, '_' or '-'"
        if current is not None and current.state not in TERMINAL_STATES:
            if current.run_id != request.run_id:
                return f"node {self.config.node_id} is busy with run {current.run_id}: stop it first"
            if request.version <= current.version:
                return f"version {request.version} is not newer than the running version {current.version}"
            return f"run {current.run_id} is still running here: stop it before pushing version {request.version}"
        if not request.HasField("plan") or not request.HasField("assignment"):
            return "a push needs a plan and an assignment"
        try:
            verify_plan(request.plan)  # the same verification as every launch path
            world = mesh_spec(request.plan).world_size
        except PlanError as exc:
            return f"invalid plan: {exc}"
        if problem := precision_problem(request.plan):
            return problem
        assignment = request.assignment
        if assignment.world_size != world:
            return f"assignment world size {assignment.world_size} does not match the plan's {world} ranks"
        ranks = list(assignment.ranks)
        if not ranks or len(set(ranks)) != len(ranks) or any(r >= world for r in ranks):
            return f"assignment ranks {ranks} must be distinct ranks below {world}"
        if len(ranks) > self.config.slots:
            return f"{len(ranks)} ranks assigned, but node {self.config.node_id} has {self.config.slots} slots"
        problem = backend_problem(assignment.backend, len(ranks), len(self.gpus), where=f"node {self.config.node_id}")
        if problem:
            return problem
        source = request.plan.model.source
        if source != WORKLOAD_SOURCE and source not in self.config.allowed_model_sources:
            return f"model source {source!r} is not allowed here: start the daemon with --allow-model-source {source}"
        if 0 not in ranks and not assignment.rendezvous_port:
            return "no rendezvous port: push to the node of rank 0 first, then pass its port to the others"
        if request.resume and not request.checkpoint_dir:
            return "a resume needs checkpoint_dir"
        if request.checkpoint_every and not request.checkpoint_dir:
            return "checkpoint_every needs checkpoint_dir (where the checkpoints go)"
        if request.checkpoint_async and not request.checkpoint_every:
            return "checkpoint_async needs checkpoint_every > 0 (the steps between checkpoints)"
        return ""

    def _launch(self, run: _Run) -> int:
        request, assignment = run.request, run.request.assignment
        host = assignment.rendezvous_host or "127.0.0.1"
        port = assignment.rendezvous_port
        if 0 in assignment.ranks:
            port = port or free_port()
        with self._lock:  # the previous run's store goes; this run's keeper holds or joins its own
            previous, self._keeper = self._keeper, None
        if previous is not None:
            previous.close()
        run.hosts_store = 0 in assignment.ranks
        run.keeper = StoreKeeper(
            self._context, host, port, is_master=run.hosts_store, timeout_s=self.config.rank_timeout_s
        )
        self._keeper = run.keeper
        if run.folder.exists():
            shutil.rmtree(run.folder)
        run.folder.mkdir(parents=True)
        steps = (request.num_steps - request.start_step) if request.num_steps else 1 << 30
        options = RunOptions(
            steps=steps,
            seed=request.seed,
            timeout_s=self.config.rank_timeout_s,
            pin_cores=self.config.pin_cores,
            start_step=request.start_step,
            checkpoint_dir=request.checkpoint_dir,
            checkpoint_every=request.checkpoint_every,
            checkpoint_async=request.checkpoint_async,
            checkpoint_keep=request.checkpoint_keep,
            resume=request.resume,
            device=backend_device(assignment.backend),
            compile=request.compile or "eager",
        )
        run.events = self._context.Queue()
        for local_rank, rank in enumerate(assignment.ranks):
            config = WorkerConfig.for_rank(
                options,
                plans=[request.plan.SerializeToString()],
                rank=rank,
                world_size=assignment.world_size,
                store_host=host,
                store_port=port,
                result_dir=str(run.folder),
                die_with_parent=True,
                adaptive=request.adaptive,
                local_rank=local_rank,
            )
            run.processes.append(start_rank(self._context, config, run.events))
            run.steps_done[rank] = request.start_step
        self._log.info("ranks_started", run=run.run_id, ranks=list(assignment.ranks), rendezvous=f"{host}:{port}")
        return port

    def _drain(self, run: _Run) -> None:
        while True:
            try:
                event = run.events.get_nowait()
            except Exception:  # queue.Empty (or a closed queue)
                return
            metrics = step_metrics(run.run_id, event)
            metrics.plan_version = run.request.version  # the launch's: a later attempt of the run has a higher one
            with self._lock:
                run.metrics.append(metrics)
                run.metrics_seen += 1
                run.steps_done[metrics.rank] = metrics.step + 1
            self._changed.notify()

    def _monitor(self, run: _Run) -> None:
        """Follow the rank processes until they end; a failure raises the abort flag for every node."""
        while True:
            self._drain(run)
            codes = [p.exitcode for p in run.processes]
            if all(code == 0 for code in codes):
                self._drain(run)
                self._set_state(run, node_pb2.RUN_STATE_DONE)
                return
            if any(code not in (None, 0) for code in codes):
                self._fail_from_ranks(run)
                return
            with self._lock:
                if run.state in TERMINAL_STATES:
                    return
            time.sleep(0.05)

    def _fail_from_ranks(self, run: _Run) -> None:
        errors = sorted(run.folder.glob("rank*.error"), key=lambda p: p.stat().st_mtime)
        first = errors[0].read_text().split("\n\n")[0] if errors else "a rank process died without a message"
        codes = {p.name: p.exitcode for p in run.processes}
        self._set_state(run, node_pb2.RUN_STATE_FAILED, f"node {self.config.node_id}: {first} (exit codes {codes})")
        self._abort_everywhere(run, f"node {self.config.node_id}: {first}")
        self._kill(run)

    def _abort_everywhere(self, run: _Run, reason: str) -> None:
        """Raise the run's abort flag in its rendezvous store, so ranks on every node leave their waits."""
        if run.keeper is not None:
            run.keeper.abort(reason)
            self._log.info("abort_flag_requested", run=run.run_id, reason=reason)

    def _kill(self, run: _Run) -> None:
        deadline = time.monotonic() + self.config.stop_grace_s
        for process in run.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in run.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def _stop_run(self, reason: str, state: int) -> int:
        with self._lock:
            run = self._run
        if run is None:
            return node_pb2.RUN_STATE_UNSPECIFIED
        if run.state not in TERMINAL_STATES:
            self._set_state(run, state, reason)
            self._abort_everywhere(run, reason)
            self._kill(run)
        return run.state

    def StopRun(self, request: node_pb2.StopRunRequest, context: grpc.ServicerContext) -> node_pb2.StopRunResponse:
        with self._lock:
            run = self._run
        if run is None or run.run_id != request.run_id:
            return node_pb2.StopRunResponse(state=node_pb2.RUN_STATE_UNSPECIFIED)
        state = self._stop_run(request.reason or "stopped by the coordinator", node_pb2.RUN_STATE_CANCELLED)
        return node_pb2.StopRunResponse(state=state)  # type: ignore[arg-type]

    def GetNodeStatus(
        self, request: node_pb2.GetNodeStatusRequest, context: grpc.ServicerContext
    ) -> node_pb2.GetNodeStatusResponse:
        return node_pb2.GetNodeStatusResponse(status=self._status())

    def WatchNodeStatus(self, request: node_pb2.WatchNodeStatusRequest, context: grpc.ServicerContext) -> Any:
        seen = -1
        last: bytes = b""
        while context.is_active() and not self._stopping.is_set():
            status = self._status()
            key = status.SerializeToString(deterministic=True)
            if key != last:
                last = key
                yield node_pb2.WatchNodeStatusResponse(status=status)
                if status.run_id == request.run_id and status.state in TERMINAL_STATES:
                    return
            seen = self._changed.wait(seen, 1.0)

    def StreamNodeMetrics(self, request: node_pb2.StreamNodeMetricsRequest, context: grpc.ServicerContext) -> Any:
        sent = 0
        seen = -1
        while context.is_active() and not self._stopping.is_set():
            with self._lock:
                run = self._run
                if run is None or run.run_id != request.run_id:
                    fresh: list[node_pb2.StepMetrics] = []
                    done = run is not None
                else:
                    start = max(sent, run.metrics_seen - len(run.metrics))
                    fresh = list(run.metrics)[start - (run.metrics_seen - len(run.metrics)) :]
                    sent = run.metrics_seen
                    done = run.state in TERMINAL_STATES
            for metrics in fresh:
                yield node_pb2.StreamNodeMetricsResponse(metrics=metrics)
            if done:
                return
            seen = self._changed.wait(seen, 1.0)


def default_node_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"
