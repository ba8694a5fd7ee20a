"""The coordinator's gRPC face: node RPCs (register, heartbeat) and client RPCs (submit, get, list, cancel,
resume, watch, metrics), its server and its loop thread. The work is the scheduler's and the closed loop's;
the state is in the records.

A plan is verified with the simulator's static verifier before it is queued; a
bad plan is refused with the verifier's message. Every run's record is written
to ``state_dir`` on each change, so a restarted coordinator knows its runs; a
run that was running when the coordinator stopped is re-attached when its nodes
heartbeat again, else marked failed. A failed or cancelled run resumes from its
last checkpoint.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import grpc

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.checkpoint_files import latest_checkpoint
from octopipe.execute.control.common import TERMINAL_STATES, Server, start_server, state_name
from octopipe.execute.control.coordinator.closed_loop import ClosedLoop
from octopipe.execute.control.coordinator.records import CoordinatorConfig, Records, RunRecord
from octopipe.execute.control.coordinator.results import predicted_step_us, step_results
from octopipe.execute.control.coordinator.scheduler import RunScheduler
from octopipe.execute.control.pushes import RunPusher
from octopipe.execute.control.security import ADMIN, COORDINATOR, NODE, CertPaths, Claims, require_identity
from octopipe.execute.control.state import StateLock
from octopipe.execute.control.submission import (
    adapt_problem,
    check_plan,
    options_problem,
    profile_problem,
    run_id_problem,
)
from octopipe.execute.devices import is_gpu, submission_problem
from octopipe.node.v1 import node_pb2

__all__ = ["Coordinator"]

_SERVICE = "octopipe.coordinator.v1.CoordinatorService"
_ADMIN = frozenset({ADMIN})
_NODE = frozenset({NODE})
_ALLOWED = {f"/{_SERVICE}/{m}": _NODE for m in ("RegisterNode", "Heartbeat")} | {
    f"/{_SERVICE}/{m}": _ADMIN
    for m in (
        "SubmitPlan",
        "GetRun",
        "ListRuns",
        "CancelRun",
        "WatchRun",
        "StreamRunMetrics",
        "ResumeRun",
        "ListNodes",
    )
}
#: a node registers and heartbeats only as the node its certificate names (its common name)
_CLAIMS: Claims = {
    f"/{_SERVICE}/RegisterNode": lambda r: [r.node_id],
    f"/{_SERVICE}/Heartbeat": lambda r: [r.node_id, r.status.node_id],
}
#: seconds between two passes of the coordinator's loop
_TICK_S = 0.05


class Coordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Start with ``start()``; ``stop()`` ends the loop and the server (runs keep their records)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._identity = CertPaths(config.certs, config.identity)
        require_identity(self._identity, COORDINATOR)
        self._state_lock = StateLock(config.state_dir)  # one live coordinator per state folder
        self._records = Records(config.state_dir)
        self._pusher = RunPusher(self._identity, on_metrics=self._records.add_metrics)
        self._scheduler = RunScheduler(self._records, self._pusher, ClosedLoop(self._records, self._pusher), config)
        self._stopping = threading.Event()
        self._server: Server | None = None
        self._log = self._records.log

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("the coordinator is not started")
        return self._server.address

    def start(self) -> Coordinator:
        try:
            self._server = self._start_server()
        except BaseException:
            self._state_lock.release()
            raise
        self._loop_thread = threading.Thread(target=self._loop, name="octopipe-coordinator", daemon=True)
        self._loop_thread.start()
        self._log.info("coordinator_started", address=self.address, state_dir=str(self.config.state_dir))
        return self

    def _start_server(self) -> Server:
        return start_server(
            host=self.config.listen_host,
            port=self.config.listen_port,
            identity=self._identity,
            register=lambda server: coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self, server),
            service_names=[_SERVICE],
            allowed=_ALLOWED,
            claims=_CLAIMS,
        )

    def stop(self) -> None:
        self._stopping.set()
        self._loop_thread.join(timeout=5)
        if self._server is not None:
            self._server.stop()
        self._pusher.close()
        self._state_lock.release()

    def wait(self) -> None:
        while not self._stopping.wait(1.0):
            pass

    def nodes(self) -> list[tuple[str, str, bool]]:
        """(node id, address, alive) of every registered node, in registration order."""
        return self._records.node_list()

    def _loop(self) -> None:
        while not self._stopping.wait(_TICK_S):
            try:
                self._scheduler.tick()
            except Exception:  # the loop must outlive any one bad run
                self._log.exception("coordinator_loop_error")

    # -- node RPCs --------------------------------------------------------------------------------
    def RegisterNode(
        self, request: coordinator_pb2.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterNodeResponse:
        if not request.node_id or not request.address or not request.devices:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a node registers with its id, address and devices")
        gpus = [d for d in request.devices if is_gpu(d.kind)]
        slots = len(request.devices) - len(gpus)
        refused = self._scheduler.register(request.node_id, request.address, slots, gpus)
        if refused:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, refused)
        return coordinator_pb2.RegisterNodeResponse(heartbeat_interval_ms=int(self.config.heartbeat_interval_s * 1e3))

    def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        return coordinator_pb2.HeartbeatResponse(known=self._scheduler.heartbeat(request.node_id, request.status))

    # -- client RPCs ------------------------------------------------------------------------------
    def SubmitPlan(
        self, request: coordinator_pb2.SubmitPlanRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.SubmitPlanResponse:
        records = self._records
        if request.run_id and run_id_problem(request.run_id):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, run_id_problem(request.run_id))
        with records.lock:
            existing = records.runs.get(request.run_id) if request.run_id else None
            if existing is not None:
                if existing.submit.plan.SerializeToString(deterministic=True) != request.plan.SerializeToString(
                    deterministic=True
                ):
                    context.abort(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"run {request.run_id} exists with another plan: choose a new run id",
                    )
                return coordinator_pb2.SubmitPlanResponse(run_id=request.run_id, state=existing.run.state)
        problem = run_id_problem(request.run_id) if request.run_id else ""
        if not problem and request.num_steps < 1:
            problem = "num_steps must be at least 1 (a run of no steps does nothing)"
        problem = problem or options_problem(request) or check_plan(request.plan, num_steps=request.num_steps)
        if not problem:
            problem = submission_problem(request.device)
        if not problem and request.adapt:
            problem = adapt_problem(request)
        elif not problem and request.profile.layers:
            problem = profile_problem(request.plan, request.profile)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        run_id = request.run_id or uuid.uuid4().hex[:12]
        submit = coordinator_pb2.SubmitPlanRequest()
        submit.CopyFrom(request)
        submit.run_id = run_id
        run = coordinator_pb2.Run(
            run_id=run_id,
            state=node_pb2.RUN_STATE_QUEUED,
            plan_version=1,
            num_steps=request.num_steps,
            predicted_step_time_us=predicted_step_us(request.plan, request.profile),
        )
        if request.checkpoint_every:
            root = self.config.checkpoint_root or (self.config.state_dir / "checkpoints")
            run.checkpoint_dir = str((root / run_id).resolve())
        run.submitted_at.GetCurrentTime()
        entry = RunRecord(submit=submit, run=run, plan=submit.plan)
        with records.lock:
            records.runs[run_id] = entry
            records.save(entry)
        self._log.info("run_submitted", run=run_id, plan=request.plan.name, steps=request.num_steps)
        return coordinator_pb2.SubmitPlanResponse(run_id=run_id, state=run.state)

    def _entry(self, run_id: str, context: grpc.ServicerContext) -> RunRecord:
        with self._records.lock:
            entry = self._records.runs.get(run_id)
        if entry is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no run {run_id!r}: list runs with `octopipe runs`")
        return entry

    def GetRun(
        self, request: coordinator_pb2.GetRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.GetRunResponse:
        entry = self._entry(request.run_id, context)
        with self._records.lock:
            run = coordinator_pb2.Run()
            run.CopyFrom(entry.run)
            plan = entry.plan
        losses, times, steps = step_results(plan, self._records.metrics_of(entry))
        run.losses.extend(losses)
        run.step_times_us.extend(times)
        run.result_steps.extend(steps)
        return coordinator_pb2.GetRunResponse(run=run)

    def ListRuns(
        self, request: coordinator_pb2.ListRunsRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ListRunsResponse:
        with self._records.lock:
            return coordinator_pb2.ListRunsResponse(runs=[e.run for e in self._records.runs.values()])

    def CancelRun(
        self, request: coordinator_pb2.CancelRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.CancelRunResponse:
        entry = self._entry(request.run_id, context)
        return coordinator_pb2.CancelRunResponse(run=self._scheduler.cancel(entry, request.reason))

    def ResumeRun(
        self, request: coordinator_pb2.ResumeRunRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ResumeRunResponse:
        entry = self._entry(request.run_id, context)
        with self._records.lock:
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
            if not problem and entry.submit.profile.layers:
                problem = profile_problem(plan, entry.submit.profile)
            if problem:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            step = latest_checkpoint(run.checkpoint_dir)
            entry.plan = plan
            entry.submit.plan.CopyFrom(plan)
            run.predicted_step_time_us = predicted_step_us(plan, entry.submit.profile)
            run.last_checkpoint_step = step
            run.completed_steps = step
            run.plan_version += 1
            run.resumes += 1
            run.error = ""
            run.state = node_pb2.RUN_STATE_QUEUED
            self._records.save(entry)
        self._log.info("run_resumed", run=run.run_id, from_step=step, version=run.plan_version)
        return coordinator_pb2.ResumeRunResponse(run=entry.run)

    def WatchRun(self, request: coordinator_pb2.WatchRunRequest, context: grpc.ServicerContext) -> Any:
        entry = self._entry(request.run_id, context)
        seen, last = -1, b""
        while context.is_active() and not self._stopping.is_set():
            with self._records.lock:
                snapshot = coordinator_pb2.Run()
                snapshot.CopyFrom(entry.run)
            key = snapshot.SerializeToString(deterministic=True)
            if key != last:
                last = key
                yield coordinator_pb2.WatchRunResponse(run=snapshot)
                if snapshot.state in TERMINAL_STATES:
                    return
            seen = self._records.changed.wait(seen, 1.0)

    def StreamRunMetrics(self, request: coordinator_pb2.StreamRunMetricsRequest, context: grpc.ServicerContext) -> Any:
        entry = self._entry(request.run_id, context)
        with self._records.lock:
            done = entry.run.state in TERMINAL_STATES
        if done or request.snapshot:  # what there is now (from disk once memory let it go), then the end
            for metrics in self._records.metrics_of(entry):
                yield coordinator_pb2.StreamRunMetricsResponse(metrics=metrics)
            return
        sent, seen = 0, -1
        while context.is_active() and not self._stopping.is_set():
            with self._records.lock:
                fresh = entry.metrics[sent:]
                sent = len(entry.metrics)
                done = entry.run.state in TERMINAL_STATES
            for metrics in fresh:
                yield coordinator_pb2.StreamRunMetricsResponse(metrics=metrics)
            if done:
                return
            seen = self._records.changed.wait(seen, 1.0)

    def ListNodes(
        self, request: coordinator_pb2.ListNodesRequest, context: grpc.ServicerContext
    ) -> coordinator_pb2.ListNodesResponse:
        records, now = self._records, time.monotonic()
        with records.lock:
            holding = {
                n: e.run.run_id
                for e in records.runs.values()
                if e.run.state not in TERMINAL_STATES
                for n in e.placement
            }
            nodes = [
                coordinator_pb2.NodeInfo(
                    node_id=n.node_id,
                    address=n.address,
                    slots=n.slots,
                    alive=n.alive,
                    heartbeat_age_seconds=now - n.last_seen,
                    run_id=holding.get(n.node_id, ""),
                    gpus=n.gpus,
                )
                for n in sorted(records.nodes.values(), key=lambda n: n.registered_at)
            ]
        return coordinator_pb2.ListNodesResponse(nodes=nodes)

    def add_metrics(self, run_id: str, metrics: node_pb2.StepMetrics) -> None:
        """Record one step's metrics of a run (the pusher's metric streams call this)."""
        self._records.add_metrics(run_id, metrics)
