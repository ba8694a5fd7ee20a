"""The coordinator: verifies plans, assigns ranks to node daemons, pushes plans, tracks runs.

Runs move QUEUED -> STARTING -> RUNNING -> DONE | FAILED | CANCELLED. A plan is
verified with the simulator's static verifier before it is queued; a bad plan
is refused with the verifier's message. A queued run starts when enough idle
nodes (one slot per rank) are registered: the node of rank 0 is pushed first
and answers with the rendezvous port, then the others. Node heartbeats carry
each node's run state; a node silent for ``heartbeat_timeout_s`` is declared
dead, its run fails with that cause and every other node of the run is told
to stop. Every run's record is written to ``state_dir`` on each change, so a
restarted coordinator knows its runs; a run that was running when the
coordinator stopped is re-attached when its nodes heartbeat again, else
marked failed. A failed or cancelled run resumes from its last checkpoint.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.control.common import TERMINAL_STATES, Server, Waiter, start_server, state_name
from octopipe.execute.control.pushes import RunPusher
from octopipe.execute.control.security import ADMIN, COORDINATOR, NODE, CertPaths, Claims, require_identity
from octopipe.execute.control.state import StateStore
from octopipe.execute.control.submission import adapt_problem, check_plan
from octopipe.execute.runtime.checkpoint import latest_checkpoint
from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.tune.retune import measured_gain, retune

__all__ = ["Coordinator", "CoordinatorConfig"]

_SERVICE = "octopipe.coordinator.v1.CoordinatorService"
_ADMIN = frozenset({ADMIN})
_NODE = frozenset({NODE})
_ALLOWED = {f"/{_SERVICE}/{m}": _NODE for m in ("RegisterNode", "Heartbeat")} | {
    f"/{_SERVICE}/{m}": _ADMIN
    for m in ("SubmitPlan", "GetRun", "ListRuns", "CancelRun", "WatchRun", "StreamRunMetrics", "ResumeRun")
}
#: a node registers and heartbeats only as the node its certificate names (its common name)
_CLAIMS: Claims = {
    f"/{_SERVICE}/RegisterNode": lambda r: [r.node_id],
    f"/{_SERVICE}/Heartbeat": lambda r: [r.node_id, r.status.node_id],
}
_MAX_RUN_METRICS = 50_000
#: finished runs whose metrics stay in memory (older finished runs keep their record, not their metrics)
_KEEP_FINISHED_METRICS = 16
#: closed loop: re-tune after this many completed steps unless the submission says otherwise
DEFAULT_ADAPT_AFTER = 3
#: switch only when the re-tuned plan is predicted at least this much faster
MIN_ADAPT_GAIN = 1.03


@dataclass(kw_only=True)
class CoordinatorConfig:
    certs: Path
    #: a certificate with role coordinator: the server's, and the only one daemons accept pushes and stops from
    identity: str = COORDINATOR
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    state_dir: Path = field(default_factory=lambda: Path("octopipe-coordinator"))
    #: checkpoints of run R go to checkpoint_root/R (must be storage every node sees)
    checkpoint_root: Path | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    #: a run restored after a restart fails if none of its nodes reports it within this time
    recover_after_s: float = 10.0


@dataclass
class _Node:
    node_id: str
    address: str
    slots: int
    registered_at: float
    last_seen: float
    status: node_pb2.NodeStatus = field(default_factory=node_pb2.NodeStatus)
    alive: bool = True


@dataclass
class _RunEntry:
    submit: coordinator_pb2.SubmitPlanRequest
    run: coordinator_pb2.Run
    plan: plan_pb2.Plan
    #: node id -> its ranks, while the run is placed
    placement: dict[str, list[int]] = field(default_factory=dict)
    metrics: list[node_pb2.StepMetrics] = field(default_factory=list)
    restored_at: float | None = None
    #: the placement when the run failed, and when: a node lost soon after is named as the cause
    failed_nodes: dict[str, list[int]] = field(default_factory=dict)
    failed_at: float = 0.0
    #: closed loop: "" (not yet), "busy" (re-tuning), "done"
    adapt_phase: str = ""
    done_seen_at: float = 0.0


class Coordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Start with ``start()``; ``stop()`` ends the loop and the server (runs keep their records)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._identity = CertPaths(config.certs, config.identity)
        require_identity(self._identity, COORDINATOR)
        self._lock = threading.RLock()
        self._changed = Waiter()
        self._nodes: dict[str, _Node] = {}
        self._runs: dict[str, _RunEntry] = {}
        self._finished: list[str] = []
        self._store = StateStore(config.state_dir)
        self._pusher = RunPusher(self._identity, on_metrics=self.add_metrics)
        self._stopping = threading.Event()
        self._server: Server | None = None
        self._log = structlog.get_logger("octopipe.coordinator")
        for submit, run in self._store.load():
            entry = _RunEntry(submit=submit, run=run, plan=submit.plan)
            if run.state in (node_pb2.RUN_STATE_STARTING, node_pb2.RUN_STATE_RUNNING):
                entry.restored_at = time.monotonic()
            self._runs[run.run_id] = entry
        if self._runs:
            self._log.info("runs_restored", runs=len(self._runs))

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the coordinator is not started")
        return self._server.address

    def start(self) -> Coordinator:
        self._server = start_server(
            host=self.config.listen_host,
            port=self.config.listen_port,
            identity=self._identity,
            register=lambda server: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self, server),
            service_names=[_SERVICE],
            allowed=_ALLOWED,
            claims=_CLAIMS,
        )
        self._loop_thread = threading.Thread(target=self._loop, name="octopipe-coordinator", daemon=True)
        self._loop_thread.start()
        self._log.info("coordinator_started", address=self.address, state_dir=str(self.config.state_dir))
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._loop_thread.join(timeout=5)
        if self._server is not None:
            self._server.stop()
        self._pusher.close()

    def wait(self) -> None:
        while not self._stopping.wait(1.0):
            pass

    # -- records ----------------------------------------------------------------------------------
    def _save(self, entry: _RunEntry) -> None:
        entry.run.updated_at.GetCurrentTime()
        self._store.save(entry.submit, entry.run)
        self._changed.notify()

    def _set_state(self, entry: _RunEntry, state: int, error: str = "") -> None:
        with self._lock:
            if entry.run.state == state and not error:
                return
            entry.run.state = state  # type: ignore[assignment]
            if error:
                entry.run.error = error
            self._save(entry)
            if state in TERMINAL_STATES and entry.run.run_id not in self._finished:
                self._finished.append(entry.run.run_id)
                while len(self._finished) > _KEEP_FINISHED_METRICS:  # bounded memory: old runs' metrics go
                    old = self._runs.get(self._finished.pop(0))
                    if old is not None:
                        old.metrics = []
        self._log.info("run_state", run=entry.run.run_id, state=state_name(state), error=error or None)

    def nodes(self) -> list[tuple[str, str, bool]]:
        """(node id, address, alive) of every registered node, in registration order."""
        with self._lock:
            ordered = sorted(self._nodes.values(), key=lambda n: n.registered_at)
            return [(n.node_id, n.address, n.alive) for n in ordered]

    # -- node RPCs --------------------------------------------------------------------------------
    def RegisterNode(
        self, request: coordinator_pb2.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterNodeResponse:
        if not request.node_id or not request.address or not request.devices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a node registers with its id, address and devices")
        now = time.monotonic()
        with self._lock:
            self._nodes[request.node_id] = _Node(
                node_id=request.node_id,
                address=request.address,
                slots=len(request.devices),
                registered_at=now,
                last_seen=now,
            )
        self._log.info("node_registered", node=request.node_id, address=request.address, slots=len(request.devices))
        self._changed.notify()
        return coordinator_pb2.RegisterNodeResponse(heartbeat_interval_ms=int(self.config.heartbeat_interval_s * 1e3))

    def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        with self._lock:
            node = self._nodes.get(request.node_id)
            if node is None or not node.alive:
                return coordinator_pb2.HeartbeatResponse(known=False)
            node.last_seen = time.monotonic()
            node.status.CopyFrom(request.status)
            entry = self._runs.get(request.status.run_id)
            if entry is not None:
                self._absorb(entry, node)
        return coordinator_pb2.HeartbeatResponse(known=True)

    def _absorb(self, entry: _RunEntry, node: _Node) -> None:
        """Fold one node's reported state into its run (called with the lock held)."""
        status, run = node.status, entry.run
        if status.plan_version != run.plan_version or run.state in TERMINAL_STATES:
            return
        if entry.restored_at is not None and node.node_id in run.rank_nodes:
            entry.restored_at = None
            entry.placement = _placement_of(run)
        if node.node_id not in entry.placement:
            return
        if status.state == node_pb2.RUN_STATE_FAILED:
            self._fail(entry, status.error or f"node {node.node_id} reported the run failed")
            return
        reports = [self._nodes[n].status for n in entry.placement if n in self._nodes]
        steps = [s.completed_steps for s in reports if s.run_id == run.run_id and s.plan_version == run.plan_version]
        if len(steps) == len(entry.placement) and min(steps) > run.completed_steps:
            run.completed_steps = min(steps)
            self._save(entry)
        states = {s.state for s in reports if s.run_id == run.run_id and s.plan_version == run.plan_version}
        if len(reports) == len(entry.placement) and states == {node_pb2.RUN_STATE_DONE}:
            if entry.submit.adapt and not self._metrics_complete(entry):
                return  # the closed loop's report needs every step's metrics: the streams are a moment behind
            run.last_checkpoint_step = latest_checkpoint(run.checkpoint_dir) if run.checkpoint_dir else 0
            self._release(entry)
            if entry.submit.adapt:
                gain = measured_gain(entry.metrics)
                if gain is not None:
                    before, after = gain
                    run.adapt_report += (
                        f"; measured median step {before / 1e3:.1f} ms before the switch, {after / 1e3:.1f} ms after "
                        f"(x{before / after:.3f})"
                    )
            self._set_state(entry, node_pb2.RUN_STATE_DONE)
        elif run.state == node_pb2.RUN_STATE_STARTING and node_pb2.RUN_STATE_RUNNING in states:
            self._set_state(entry, node_pb2.RUN_STATE_RUNNING)

    # -- the loop: dead nodes, restored runs, queued runs -----------------------------------------
    def _loop(self) -> None:
        while not self._stopping.wait(0.05):
            try:
                self._check_nodes()
                self._check_restored()
                self._start_queued()
                self._check_adapt()
            except Exception:  # the loop must outlive any one bad run
                self._log.exception("coordinator_loop_error")

    def _check_nodes(self) -> None:
        now = time.monotonic()
        with self._lock:
            for node in self._nodes.values():
                silent = now - node.last_seen
                if node.alive and silent > self.config.heartbeat_timeout_s:
                    node.alive = False
                    self._log.warning("node_lost", node=node.node_id, silent_s=round(silent, 2))
                    cause = (
                        f"node {node.node_id} ({node.address}) missed heartbeats for {silent:.1f} s "
                        f"(timeout {self.config.heartbeat_timeout_s} s): it died or was cut off"
                    )
                    for entry in self._runs.values():
                        if node.node_id in entry.placement and entry.run.state not in TERMINAL_STATES:
                            self._fail(entry, cause)
                        elif node.node_id in entry.failed_nodes and now - entry.failed_at < 2 * silent + 5:
                            # the run already failed through a rank that lost its peer: name the root cause
                            self._set_state(entry, entry.run.state, f"{cause}; first report: {entry.run.error}")
                            entry.failed_nodes = {}

    def _check_restored(self) -> None:
        now = time.monotonic()
        with self._lock:
            for entry in self._runs.values():
                if entry.restored_at is not None and now - entry.restored_at > self.config.recover_after_s:
                    entry.restored_at = None
                    self._fail(entry, "the coordinator restarted and no node of the run reported it running: resume it")

    def _fail(self, entry: _RunEntry, error: str) -> None:
        """Mark the run failed and stop it on every node it has (called with the lock held)."""
        if entry.run.state in TERMINAL_STATES:
            return
        if entry.run.checkpoint_dir:
            entry.run.last_checkpoint_step = latest_checkpoint(entry.run.checkpoint_dir)
        entry.failed_nodes, entry.failed_at = dict(entry.placement), time.monotonic()
        self._set_state(entry, node_pb2.RUN_STATE_FAILED, error)
        targets = [self._nodes[n].address for n in entry.placement if n in self._nodes and self._nodes[n].alive]
        self._release(entry)
        self._pusher.stop_async(entry.run.run_id, targets, error)

    def _release(self, entry: _RunEntry) -> None:
        entry.placement = {}

    def _busy_nodes(self) -> set[str]:
        return {n for e in self._runs.values() if e.run.state not in TERMINAL_STATES for n in e.placement}

    def _start_queued(self) -> None:
        with self._lock:
            queued = [e for e in self._runs.values() if e.run.state == node_pb2.RUN_STATE_QUEUED]
            if not queued:
                return
            entry = min(queued, key=lambda e: e.run.submitted_at.ToNanoseconds())
            world = mesh_spec(entry.plan).world_size
            busy = self._busy_nodes()
            idle = sorted(
                (n for n in self._nodes.values() if n.alive and n.node_id not in busy), key=lambda n: n.registered_at
            )
            placement: dict[str, list[int]] = {}
            next_rank = 0
            for node in idle:
                if next_rank == world:
                    break
                take = min(node.slots, world - next_rank)
                placement[node.node_id] = list(range(next_rank, next_rank + take))
                next_rank += take
            if next_rank < world:
                return
            entry.placement = placement
            entry.run.ClearField("rank_nodes")
            for node_id, ranks in placement.items():
                entry.run.rank_nodes.extend([node_id] * len(ranks))
            entry.run.state = node_pb2.RUN_STATE_STARTING
            self._save(entry)
            addresses = {n: self._nodes[n].address for n in placement}
        error = self._pusher.push(entry.run, entry.submit, entry.plan, placement, addresses)
        if error:
            with self._lock:
                self._fail(entry, error)

    def _metrics_complete(self, entry: _RunEntry) -> bool:
        """Whether every rank's every step has arrived (waits at most 5 s after the nodes say done)."""
        entry.done_seen_at = entry.done_seen_at or time.monotonic()
        world = mesh_spec(entry.plan).world_size
        expected = world * (entry.run.num_steps - (entry.run.last_checkpoint_step if entry.run.resumes else 0))
        return len(entry.metrics) >= expected or time.monotonic() - entry.done_seen_at > 5.0

    def _measured_steps(self, entry: _RunEntry) -> int:
        """Steps every rank has reported metrics for, before any plan switch."""
        world = mesh_spec(entry.plan).world_size
        return sum(1 for m in entry.metrics if m.plan_switches == 0) // world

    def _check_adapt(self) -> None:
        with self._lock:
            ready = [
                e
                for e in self._runs.values()
                if e.submit.adapt
                and not e.adapt_phase
                and e.run.state == node_pb2.RUN_STATE_RUNNING
                and self._measured_steps(e) >= (e.submit.adapt_after_steps or DEFAULT_ADAPT_AFTER)
            ]
            for entry in ready:
                entry.adapt_phase = "busy"
        for entry in ready:
            threading.Thread(target=self._adapt, args=(entry,), name="octopipe-adapt", daemon=True).start()

    def _adapt(self, entry: _RunEntry) -> None:
        """Re-tune from the measured steps (the first skipped) and switch when the gain is worth it."""
        try:
            with self._lock:
                plan = entry.plan
                timelines = [m.timeline for m in entry.metrics if m.step >= 1 and m.plan_switches == 0]
            result = retune(plan, entry.submit.profile, timelines)
            report = (
                f"after {len(timelines) // mesh_spec(plan).world_size} measured steps (the first skipped): running {plan.labels.get('schedule', plan.name)} "
                f"predicted {result.current_us / 1e3:.1f} ms/step with measured costs; best {result.name} "
                f"{result.best_us / 1e3:.1f} ms (x{result.predicted_gain:.3f})"
            )
            with self._lock:
                if entry.run.state != node_pb2.RUN_STATE_RUNNING:
                    return
                switch = result.predicted_gain >= MIN_ADAPT_GAIN and result.name != "current"
                if switch:
                    entry.run.plan_version += 1
                    result.plan.version = entry.run.plan_version
                    addresses = {n: self._nodes[n].address for n in entry.placement if n in self._nodes}
                    placement = dict(entry.placement)
                entry.run.adapt_report = report + ("; switching" if switch else "; kept the running plan")
                self._save(entry)
            if switch:
                error = self._pusher.switch(entry.run, result.plan, placement, addresses)
                with self._lock:
                    if error:
                        entry.run.adapt_report += f"; switch failed: {error}"
                    else:
                        entry.plan = result.plan
                        entry.submit.plan.CopyFrom(result.plan)
                    self._save(entry)
            self._log.info("adapted", run=entry.run.run_id, report=entry.run.adapt_report)
        except Exception as exc:  # the run goes on with its plan
            self._log.exception("adapt_failed", run=entry.run.run_id)
            with self._lock:
                entry.run.adapt_report = f"re-tuning failed: {exc}"
                self._save(entry)
        finally:
            entry.adapt_phase = "done"

    # -- client RPCs ------------------------------------------------------------------------------
    def SubmitPlan(
        self, request: coordinator_pb2.SubmitPlanRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.SubmitPlanResponse:
        with self._lock:
            existing = self._runs.get(request.run_id) if request.run_id else None
            if existing is not None:
                if existing.submit.plan.SerializeToString(deterministic=True) != request.plan.SerializeToString(
                    deterministic=True
                ):
                    context.abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"run {request.run_id} exists with another plan: choose a new run id",
                    )
                return coordinator_pb2.SubmitPlanResponse(run_id=request.run_id, state=existing.run.state)
        problem = check_plan(request.plan, num_steps=request.num_steps)
        if not problem and request.adapt:
            problem = adapt_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        run_id = request.run_id or uuid.uuid4().hex[:12]
        submit = coordinator_pb2.SubmitPlanRequest()
        submit.CopyFrom(request)
        submit.run_id = run_id
        run = coordinator_pb2.Run(
            run_id=run_id, state=node_pb2.RUN_STATE_QUEUED, plan_version=1, num_steps=request.num_steps
        )
        if request.checkpoint_every:
            root = self.config.checkpoint_root or (self.config.state_dir / "checkpoints")
            run.checkpoint_dir = str((root / run_id).resolve())
        run.submitted_at.GetCurrentTime()
        entry = _RunEntry(submit=submit, run=run, plan=submit.plan)
        with self._lock:
            self._runs[run_id] = entry
            self._save(entry)
        self._log.info("run_submitted", run=run_id, plan=request.plan.name, steps=request.num_steps)
        return coordinator_pb2.SubmitPlanResponse(run_id=run_id, state=run.state)

    def _entry(self, run_id: str, context: grpc.ServicerContext) -> _RunEntry:
        with self._lock:
            entry = self._runs.get(run_id)
        if entry is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no run {run_id!r}: list runs with `octopipe runs`")
        return entry

    def GetRun(
        self, request: coordinator_pb2.GetRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetRunResponse:
        entry = self._entry(request.run_id, context)
        with self._lock:
            return coordinator_pb2.GetRunResponse(run=entry.run)

    def ListRuns(
        self, request: coordinator_pb2.ListRunsRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ListRunsResponse:
        with self._lock:
            return coordinator_pb2.ListRunsResponse(runs=[e.run for e in self._runs.values()])

    def CancelRun(
        self, request: coordinator_pb2.CancelRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.CancelRunResponse:
        entry = self._entry(request.run_id, context)
        with self._lock:
            if entry.run.state not in TERMINAL_STATES:
                targets = [self._nodes[n].address for n in entry.placement if n in self._nodes]
                self._release(entry)
                self._set_state(entry, node_pb2.RUN_STATE_CANCELLED, request.reason or "cancelled by a client")
                self._pusher.stop_async(entry.run.run_id, targets, request.reason or "cancelled")
            return coordinator_pb2.CancelRunResponse(run=entry.run)

    def ResumeRun(
        self, request: coordinator_pb2.ResumeRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ResumeRunResponse:
        entry = self._entry(request.run_id, context)
        with self._lock:
            run = entry.run
            if run.state not in (node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_CANCELLED):
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"run {run.run_id} is {state_name(run.state)}: only a failed or cancelled run resumes",
                )
            if not run.checkpoint_dir:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"run {run.run_id} took no checkpoints: submit with checkpoint_every > 0 to make runs resumable",
                )
            plan = request.plan if request.HasField("plan") else entry.plan
            problem = check_plan(plan, num_steps=run.num_steps, like=entry.plan)
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            step = latest_checkpoint(run.checkpoint_dir)
            entry.plan = plan
            entry.submit.plan.CopyFrom(plan)
            run.last_checkpoint_step = step
            run.completed_steps = step
            run.plan_version += 1
            run.resumes += 1
            run.error = ""
            run.state = node_pb2.RUN_STATE_QUEUED
            self._save(entry)
        self._log.info("run_resumed", run=run.run_id, from_step=step, version=run.plan_version)
        return coordinator_pb2.ResumeRunResponse(run=entry.run)

    def WatchRun(self, request: coordinator_pb2.WatchRunRequest, context: grpc.ServicerContext) -> Any:
        entry = self._entry(request.run_id, context)
        seen, last = -1, b""
        while context.is_active() and not self._stopping.is_set():
            with self._lock:
                snapshot = coordinator_pb2.Run()
                snapshot.CopyFrom(entry.run)
            key = snapshot.SerializeToString(deterministic=True)
            if key != last:
                last = key
                yield coordinator_pb2.WatchRunResponse(run=snapshot)
                if snapshot.state in TERMINAL_STATES:
                    return
            seen = self._changed.wait(seen, 1.0)

    def StreamRunMetrics(self, request: coordinator_pb2.StreamRunMetricsRequest, context: grpc.ServicerContext) -> Any:
        entry = self._entry(request.run_id, context)
        sent, seen = 0, -1
        while context.is_active() and not self._stopping.is_set():
            with self._lock:
                fresh = entry.metrics[sent:]
                sent = len(entry.metrics)
                done = entry.run.state in TERMINAL_STATES
            for metrics in fresh:
                yield coordinator_pb2.StreamRunMetricsResponse(metrics=metrics)
            if done:
                return
            seen = self._changed.wait(seen, 1.0)

    # -- used by the pusher's metric streams and the adapt loop -----------------------------------
    def add_metrics(self, run_id: str, metrics: node_pb2.StepMetrics) -> None:
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None or len(entry.metrics) >= _MAX_RUN_METRICS:
                return
            entry.metrics.append(metrics)
        self._changed.notify()


def _placement_of(run: coordinator_pb2.Run) -> dict[str, list[int]]:
    placement: dict[str, list[int]] = {}
    for rank, node_id in enumerate(run.rank_nodes):
        placement.setdefault(node_id, []).append(rank)
    return placement
