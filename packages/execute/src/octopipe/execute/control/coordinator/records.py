"""The coordinator's records: its configuration, registered nodes, runs (persisted on every change), and
the lock and change signal every part of the coordinator shares."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.control.common import TERMINAL_STATES, Waiter, state_name
from octopipe.execute.control.security import COORDINATOR
from octopipe.execute.control.state import StateStore
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2

__all__ = ["CoordinatorConfig", "NodeRecord", "Records", "RunRecord", "placement_of"]

#: a run keeps at most this many step metrics in memory
_MAX_RUN_METRICS = 50_000
#: finished runs whose metrics stay in memory (older finished runs keep their record, not their metrics)
_KEEP_FINISHED_METRICS = 16


@dataclass
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
    #: a queued run that needs more slots than the live nodes have fails after this long
    never_fits_after_s: float = 600.0


@dataclass
class NodeRecord:
    node_id: str
    address: str
    slots: int
    registered_at: float
    last_seen: float
    status: node_pb2.NodeStatus = field(default_factory=node_pb2.NodeStatus)
    alive: bool = True
    #: the GPUs the node reported (``Device`` of kind ``cuda``)
    gpus: list[coordinator_pb2.Device] = field(default_factory=list)


@dataclass
class RunRecord:
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
    #: since when the run has needed more slots than the live nodes have (None: it would fit)
    unfit_since: float | None = None
    #: recovering since (monotonic; None: not recovering), and whether its re-plan is being tuned
    recovering_since: float | None = None
    replanning: bool = False
    #: metrics restored from disk after a coordinator restart (serialized): a node's stream, followed again,
    #: replays them, and they are not kept twice
    restored_metrics: set[bytes] = field(default_factory=set)


class Records:
    """Nodes and runs under one lock; every change to a run is saved to ``state_dir`` and signalled."""

    def __init__(self, state_dir: Path) -> None:
        self.lock = threading.RLock()
        #: notified on every change (watchers wait on it)
        self.changed = Waiter()
        self.nodes: dict[str, NodeRecord] = {}
        self.runs: dict[str, RunRecord] = {}
        self._finished: list[str] = []
        self._store = StateStore(state_dir)
        self.log = structlog.get_logger("octopipe.coordinator")
        for submit, run in self._store.load():
            entry = RunRecord(submit=submit, run=run, plan=submit.plan)
            if run.state in (node_pb2.RUN_STATE_STARTING, node_pb2.RUN_STATE_RUNNING):
                entry.restored_at = time.monotonic()
            if run.state == node_pb2.RUN_STATE_RECOVERING:
                entry.recovering_since = time.monotonic()
            if run.state not in TERMINAL_STATES:  # its streams go on where they were: earlier metrics first
                entry.metrics = self._store.load_metrics(run.run_id)[:_MAX_RUN_METRICS]
                entry.restored_metrics = {m.SerializeToString(deterministic=True) for m in entry.metrics}
            self.runs[run.run_id] = entry
        if self.runs:
            self.log.info("runs_restored", runs=len(self.runs))

    def save(self, entry: RunRecord) -> None:
        entry.run.updated_at.GetCurrentTime()
        self._store.save(entry.submit, entry.run)
        self.changed.notify()

    def set_state(self, entry: RunRecord, state: int, error: str = "") -> None:
        with self.lock:
            if entry.run.state == state and not error:
                return
            entry.run.state = state  # type: ignore[assignment]
            if error:
                entry.run.error = error
            self.save(entry)
            if state in TERMINAL_STATES and entry.run.run_id not in self._finished:
                self._finished.append(entry.run.run_id)
                while len(self._finished) > _KEEP_FINISHED_METRICS:  # bounded memory: old runs' metrics go
                    old = self.runs.get(self._finished.pop(0))
                    if old is not None:
                        old.metrics = []
        self.log.info("run_state", run=entry.run.run_id, state=state_name(state), error=error or None)

    def node_list(self) -> list[tuple[str, str, bool]]:
        """(node id, address, alive) of every registered node, in registration order."""
        with self.lock:
            ordered = sorted(self.nodes.values(), key=lambda n: n.registered_at)
            return [(n.node_id, n.address, n.alive) for n in ordered]

    def addresses(self, node_ids: Iterable[str], *, alive_only: bool = False) -> dict[str, str]:
        """node id -> address of the registered nodes among ``node_ids`` (call with the lock held)."""
        return {
            n: self.nodes[n].address for n in node_ids if n in self.nodes and (self.nodes[n].alive or not alive_only)
        }

    def add_metrics(self, run_id: str, metrics: node_pb2.StepMetrics) -> None:
        """Keep one step's metrics: on disk always (protobuf), in memory up to a bound."""
        with self.lock:
            entry = self.runs.get(run_id)
            if entry is None:
                return
            if entry.restored_metrics and metrics.SerializeToString(deterministic=True) in entry.restored_metrics:
                return  # a node's stream, followed again after a restart, replays what the store has
            self._store.append_metrics(run_id, metrics)
            if len(entry.metrics) < _MAX_RUN_METRICS:
                entry.metrics.append(metrics)
        self.changed.notify()

    def metrics_of(self, entry: RunRecord) -> list[node_pb2.StepMetrics]:
        """Every metric of the run: from memory, or from disk once memory let them go (an old finished run, a
        restarted coordinator)."""
        with self.lock:
            if entry.metrics:
                return list(entry.metrics)
        return self._store.load_metrics(entry.run.run_id)


def placement_of(run: coordinator_pb2.Run) -> dict[str, list[int]]:
    """node id -> its ranks, from the run's rank -> node list."""
    placement: dict[str, list[int]] = {}
    for rank, node_id in enumerate(run.rank_nodes):
        placement.setdefault(node_id, []).append(rank)
    return placement
