"""A client of the coordinator (what `octopipe submit`, `runs` and `resume` use)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc

from octopipe.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from octopipe.execute.control.common import RPC_DEADLINE_S, TERMINAL_STATES
from octopipe.execute.control.security import CertPaths, secure_channel
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2

__all__ = ["ControlClient", "ControlError"]


class ControlError(RuntimeError):
    """A refused or failed call, in one line that says what to do; ``code`` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


def _explain(exc: grpc.RpcError, target: str) -> ControlError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = (
            "check that the coordinator runs there and that --certs holds a certificate signed by the cluster's CA"
            if "handshake" in details.lower() or "ssl" in details.lower() or "tls" in details.lower()
            else "check that the coordinator runs there"
        )
        return ControlError(f"cannot reach the coordinator at {target} ({details}): {hint}", code)
    return ControlError(details or code.name, code)  # the status is in .code; the message is the reason


class ControlClient:
    """Mutual-TLS client of a coordinator at ``target`` (host:port), as identity ``identity`` in ``certs``."""

    def __init__(self, target: str, certs: Path, identity: str = "admin") -> None:
        self.target = target
        self._channel = secure_channel(target, CertPaths(certs, identity))
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def submit(
        self,
        plan: plan_pb2.Plan,
        *,
        steps: int,
        run_id: str = "",
        checkpoint_every: int = 0,
        seed: int = 0,
        adapt_profile: profile_pb2.Profile | None = None,
        adapt_after_steps: int = 0,
        profile: profile_pb2.Profile | None = None,
        device: str = "",
        checkpoint_async: bool = False,
        checkpoint_keep: int = 0,
        recovery: coordinator_pb2.RecoveryPolicy | None = None,
        queue_deadline_s: float = 0.0,
        compile: str = "",
    ) -> str:
        """Submit a plan; with ``adapt_profile`` the coordinator re-tunes it from measured steps (closed loop);
        with ``profile`` (or ``adapt_profile``) it predicts the step time (``Run.predicted_step_time_us``);
        ``device`` ``cuda`` places the ranks on the nodes' GPUs. ``checkpoint_async`` writes checkpoints in
        the background, ``checkpoint_keep`` keeps the newest that many; ``recovery`` heals the run when it
        loses a node or a rank (re-planning needs ``profile``); ``queue_deadline_s`` fails it if it cannot
        be placed for that long; ``compile`` (eager, inductor, auto; empty: eager) says how the stage graphs run."""
        if adapt_profile is not None and profile is not None:
            raise ValueError("give the profile once: adapt_profile is also the one the prediction uses")
        request = coordinator_pb2.SubmitPlanRequest(
            plan=plan,
            num_steps=steps,
            run_id=run_id,
            checkpoint_every=checkpoint_every,
            seed=seed,
            device=device,
            checkpoint_async=checkpoint_async,
            checkpoint_keep=checkpoint_keep,
            queue_deadline_s=queue_deadline_s,
            compile=compile,
        )
        if recovery is not None:
            request.recovery.CopyFrom(recovery)
        if adapt_profile is not None:
            request.adapt, request.adapt_after_steps = True, adapt_after_steps
            request.profile.CopyFrom(adapt_profile)
        elif profile is not None:
            request.profile.CopyFrom(profile)
        try:
            return self._stub.SubmitPlan(request, timeout=RPC_DEADLINE_S).run_id
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def run(self, run_id: str) -> coordinator_pb2.Run:
        try:
            return self._stub.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id), timeout=RPC_DEADLINE_S).run
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def runs(self) -> list[coordinator_pb2.Run]:
        try:
            return list(self._stub.ListRuns(coordinator_pb2.ListRunsRequest(), timeout=RPC_DEADLINE_S).runs)
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def nodes(self) -> list[coordinator_pb2.NodeInfo]:
        """The registered nodes: slots, liveness, heartbeat age and the run each holds."""
        try:
            return list(self._stub.ListNodes(coordinator_pb2.ListNodesRequest(), timeout=RPC_DEADLINE_S).nodes)
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def cancel(self, run_id: str, reason: str = "") -> coordinator_pb2.Run:
        try:
            request = coordinator_pb2.CancelRunRequest(run_id=run_id, reason=reason)
            return self._stub.CancelRun(request, timeout=RPC_DEADLINE_S).run
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def resume(self, run_id: str, plan: plan_pb2.Plan | None = None) -> coordinator_pb2.Run:
        request = coordinator_pb2.ResumeRunRequest(run_id=run_id)
        if plan is not None:
            request.plan.CopyFrom(plan)
        try:
            return self._stub.ResumeRun(request, timeout=RPC_DEADLINE_S).run
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def watch(self, run_id: str, *, timeout_s: float) -> Iterator[coordinator_pb2.Run]:
        """Each change of the run until it ends (or ``timeout_s``: then TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        try:
            for response in self._stub.WatchRun(coordinator_pb2.WatchRunRequest(run_id=run_id), timeout=timeout_s):
                yield response.run
                if response.run.state in TERMINAL_STATES:
                    return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} did not finish within {timeout_s:.0f} s") from None
            raise _explain(exc, self.target) from None
        raise TimeoutError(f"the coordinator ended the watch of run {run_id} before it finished")

    def wait(self, run_id: str, *, timeout_s: float) -> coordinator_pb2.Run:
        """The run's record once it is done, failed or cancelled."""
        runs = list(self.watch(run_id, timeout_s=timeout_s))
        return runs[-1]

    def metrics(self, run_id: str, *, timeout_s: float = 60.0, follow: bool = True) -> list[node_pb2.StepMetrics]:
        """Every step metric of a run: streamed until the run ends, or (``follow=False``) those there are now."""
        request = coordinator_pb2.StreamRunMetricsRequest(run_id=run_id, snapshot=not follow)
        try:
            return [r.metrics for r in self._stub.StreamRunMetrics(request, timeout=timeout_s)]
        except grpc.RpcError as exc:
            raise _explain(exc, self.target) from None

    def follow_metrics(self, run_id: str, *, timeout_s: float) -> Iterator[node_pb2.StepMetrics]:
        """A run's step metrics as they arrive, until it ends (or ``timeout_s``)."""
        request = coordinator_pb2.StreamRunMetricsRequest(run_id=run_id)
        try:
            for response in self._stub.StreamRunMetrics(request, timeout=timeout_s):
                yield response.metrics
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"run {run_id} still running after {timeout_s:g} s") from None
            raise _explain(exc, self.target) from None
