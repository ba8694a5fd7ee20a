"""The coordinator's run scheduler: places queued runs on idle nodes and pushes them, folds node heartbeats
into run states, declares silent nodes dead and fails their runs, and fails restored runs nobody reports.

Runs move QUEUED -> STARTING -> RUNNING -> DONE | FAILED | CANCELLED. A queued
run starts when enough idle nodes (one slot per rank) are registered: the node
of rank 0 is pushed first and answers with the rendezvous port, then the others.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.checkpoint_files import latest_checkpoint
from octopipe.execute.control.common import TERMINAL_STATES
from octopipe.execute.control.coordinator.closed_loop import ClosedLoop
from octopipe.execute.control.coordinator.records import (
    CoordinatorConfig,
    NodeRecord,
    Records,
    RunRecord,
    placement_of,
)
from octopipe.execute.control.coordinator.recovery import Recoveries
from octopipe.execute.control.pushes import RunPusher
from octopipe.execute.devices import capacity, is_gpu
from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2

__all__ = ["RunScheduler"]


class RunScheduler:
    """What the coordinator's loop does every tick, and what node heartbeats change."""

    def __init__(self, records: Records, pusher: RunPusher, closed_loop: ClosedLoop, config: CoordinatorConfig) -> None:
        self._records = records
        self._pusher = pusher
        self._closed_loop = closed_loop
        self._config = config
        self._recoveries = Recoveries(records, pusher, config)

    def tick(self) -> None:
        """One pass: dead nodes, restored runs nobody reported, recovering runs, the oldest queued run, the
        closed loop."""
        self._check_nodes()
        self._check_restored()
        self._recoveries.check()
        self._start_queued()
        self._closed_loop.check()

    # -- nodes ------------------------------------------------------------------------------------
    def register(self, node_id: str, address: str, slots: int, gpus: Sequence[coordinator_pb2.Device] = ()) -> str:
        """Record a node (its slots and the GPUs it reported); refused ('' when taken) while another live daemon
        holds ``node_id`` elsewhere."""
        now = time.monotonic()
        with self._records.lock:
            known = self._records.nodes.get(node_id)
            if known is not None and known.alive and known.address != address:
                return (
                    f"node {node_id} is registered and alive at {known.address} (heard from "
                    f"{now - known.last_seen:.1f} s ago): stop that daemon, or start this one with another node id"
                )
            self._records.nodes[node_id] = NodeRecord(
                node_id=node_id, address=address, slots=slots, registered_at=now, last_seen=now, gpus=list(gpus)
            )
        self._pusher.forget(node_id)  # a fresh channel: the old one may be backing off from the node's absence
        self._records.log.info("node_registered", node=node_id, address=address, slots=slots)
        self._records.changed.notify()
        return ""

    def heartbeat(self, node_id: str, status: node_pb2.NodeStatus) -> bool:
        """Fold a node's status into its run; False for a node the coordinator does not know (or declared dead)."""
        records = self._records
        with records.lock:
            node = records.nodes.get(node_id)
            if node is None or not node.alive:
                return False
            node.last_seen = time.monotonic()
            node.status.CopyFrom(status)
            entry = records.runs.get(status.run_id)
            if entry is not None:
                self._absorb(entry, node)
        return True

    def _absorb(self, entry: RunRecord, node: NodeRecord) -> None:
        """Fold one node's reported state into its run (called with the lock held)."""
        records = self._records
        status, run = node.status, entry.run
        if status.plan_version != run.plan_version or run.state in TERMINAL_STATES:
            return
        if entry.restored_at is not None and node.node_id in run.rank_nodes:
            entry.restored_at = None
            entry.placement = placement_of(run)
            for node_id in entry.placement:  # the metrics streams of a run re-attached after a restart
                if node_id in records.nodes:
                    self._pusher.follow(run.run_id, node_id, records.nodes[node_id].address)
        if node.node_id not in entry.placement:
            return
        if status.state == node_pb2.RUN_STATE_FAILED:
            self.fail_or_recover(entry, status.error or f"node {node.node_id} reported the run failed")
            return
        reports = [records.nodes[n].status for n in entry.placement if n in records.nodes]
        steps = [s.completed_steps for s in reports if s.run_id == run.run_id and s.plan_version == run.plan_version]
        if len(steps) == len(entry.placement) and min(steps) > run.completed_steps:
            run.completed_steps = min(steps)
            if run.checkpoint_dir:  # as steps pass, not only at the end (a complete checkpoint has every rank's)
                run.last_checkpoint_step = latest_checkpoint(run.checkpoint_dir)
            self._recoveries.progressed(entry)
            records.save(entry)
        states = {s.state for s in reports if s.run_id == run.run_id and s.plan_version == run.plan_version}
        if len(reports) == len(entry.placement) and states == {node_pb2.RUN_STATE_DONE}:
            if entry.submit.adapt and not self._closed_loop.metrics_complete(entry):
                return  # the closed loop's report needs every step's metrics: the streams are a moment behind
            run.last_checkpoint_step = latest_checkpoint(run.checkpoint_dir) if run.checkpoint_dir else 0
            entry.placement = {}
            if entry.submit.adapt:
                self._closed_loop.report_gain(entry)
            self._recoveries.finished(entry)
            records.set_state(entry, node_pb2.RUN_STATE_DONE)
        elif run.state == node_pb2.RUN_STATE_STARTING and node_pb2.RUN_STATE_RUNNING in states:
            records.set_state(entry, node_pb2.RUN_STATE_RUNNING)

    def _check_nodes(self) -> None:
        records, timeout = self._records, self._config.heartbeat_timeout_s
        now = time.monotonic()
        with records.lock:
            for node in records.nodes.values():
                silent = now - node.last_seen
                if node.alive and silent > timeout:
                    node.alive = False
                    records.log.warning("node_lost", node=node.node_id, silent_s=round(silent, 2))
                    cause = (
                        f"node {node.node_id} ({node.address}) missed heartbeats for {silent:.1f} s "
                        f"(timeout {timeout} s): it died or was cut off"
                    )
                    for entry in records.runs.values():
                        if node.node_id in entry.placement and entry.run.state not in TERMINAL_STATES:
                            self.fail_or_recover(entry, cause)
                        elif node.node_id in entry.failed_nodes and now - entry.failed_at < 2 * silent + 5:
                            # the run already failed through a rank that lost its peer: name the root cause
                            self._recoveries.name_cause(entry, cause)
                            records.set_state(entry, entry.run.state, f"{cause}; first report: {entry.run.error}")
                            entry.failed_nodes = {}

    # -- runs -------------------------------------------------------------------------------------
    def _check_restored(self) -> None:
        now = time.monotonic()
        with self._records.lock:
            for entry in self._records.runs.values():
                if entry.restored_at is not None and now - entry.restored_at > self._config.recover_after_s:
                    entry.restored_at = None
                    self.fail_or_recover(
                        entry, "the coordinator restarted and no node of the run reported it running: resume it"
                    )

    def fail_or_recover(self, entry: RunRecord, error: str) -> None:
        """Recover the run if its policy says so, else fail it (called with the lock held)."""
        why_not = self._recoveries.begin(entry, error)
        if why_not:
            self.fail(entry, error if why_not == "no automatic recovery" else f"{error}; {why_not}")

    def fail(self, entry: RunRecord, error: str) -> None:
        """Mark the run failed and stop it on every node it has (called with the lock held)."""
        if entry.run.state in TERMINAL_STATES:
            return
        if entry.run.checkpoint_dir:
            entry.run.last_checkpoint_step = latest_checkpoint(entry.run.checkpoint_dir)
        entry.failed_nodes, entry.failed_at = dict(entry.placement), time.monotonic()
        self._records.set_state(entry, node_pb2.RUN_STATE_FAILED, error)
        targets = self._records.addresses(entry.placement, alive_only=True)
        entry.placement = {}
        self._pusher.stop_async(entry.run.run_id, targets, error)

    def cancel(self, entry: RunRecord, reason: str) -> coordinator_pb2.Run:
        """Cancel a run that has not ended and stop it on its nodes; the run as it now stands."""
        with self._records.lock:
            if entry.run.state not in TERMINAL_STATES:
                targets = self._records.addresses(entry.placement)
                entry.placement = {}
                if entry.submit.adapt:  # the closed loop's measured gain, from the steps reported so far
                    self._closed_loop.report_gain(entry)
                self._records.set_state(entry, node_pb2.RUN_STATE_CANCELLED, reason or "cancelled by a client")
                self._pusher.stop_async(entry.run.run_id, targets, reason or "cancelled")
            return entry.run

    def _start_queued(self) -> None:
        """Start the oldest queued run that fits the idle nodes; a run that does not fit waits (its
        ``waiting_for`` says for what) without holding back the runs behind it, and fails once it has not fit
        even the registered nodes for ``never_fits_after_s``."""
        records = self._records
        now = time.monotonic()
        with records.lock:
            queued = sorted(
                (e for e in records.runs.values() if e.run.state == node_pb2.RUN_STATE_QUEUED),
                key=lambda e: e.run.submitted_at.ToNanoseconds(),
            )
            if not queued:
                return
            busy = {n for e in records.runs.values() if e.run.state not in TERMINAL_STATES for n in e.placement}
            alive = sorted((n for n in records.nodes.values() if n.alive), key=lambda n: n.registered_at)
            idle = [n for n in alive if n.node_id not in busy]
            chosen: tuple[RunRecord, dict[str, list[int]]] | None = None
            for entry in queued:
                world = mesh_spec(entry.plan).world_size
                placement = _place(world, idle, entry.submit.device)
                if placement is not None:
                    chosen = (entry, placement)
                    break
                self._wait(entry, world, alive, idle, now)
            if chosen is None:
                return
            entry, placement = chosen
            entry.unfit_since = None
            entry.run.waiting_for = ""
            entry.placement = placement
            entry.run.ClearField("rank_nodes")
            for node_id, ranks in placement.items():
                entry.run.rank_nodes.extend([node_id] * len(ranks))
            entry.run.state = node_pb2.RUN_STATE_STARTING
            records.save(entry)
            addresses = {n: records.nodes[n].address for n in placement}
        error = self._pusher.push(entry.run, entry.submit, entry.plan, placement, addresses)
        with records.lock:
            if error:
                self.fail_or_recover(entry, error)
            elif entry.run.state not in TERMINAL_STATES:
                self._recoveries.placed(entry)
                records.save(entry)
            elif entry.run.state in TERMINAL_STATES:  # cancelled while the pushes were in flight: a stop sent
                # then may have reached a node before its push did, so stop every pushed node again
                self._pusher.stop_async(entry.run.run_id, addresses, entry.run.error or "cancelled")

    def _wait(self, entry: RunRecord, world: int, alive: list[NodeRecord], idle: list[NodeRecord], now: float) -> None:
        """Say why ``entry`` waits; fail it once even every registered slot has been too few for too long
        (called with the lock held)."""
        kind = entry.submit.device
        registered = sum(capacity(kind, n.slots, len(n.gpus)) for n in alive)
        free = sum(capacity(kind, n.slots, len(n.gpus)) for n in idle)
        unit = "GPU slots" if is_gpu(kind or "cpu") else "slots"
        reason = f"waiting for {world} {unit}: {registered} registered on {len(alive)} live nodes, {free} idle"
        if registered < world:
            entry.unfit_since = entry.unfit_since if entry.unfit_since is not None else now
            limit = entry.submit.queue_deadline_s or self._config.never_fits_after_s
            if now - entry.unfit_since > limit:
                entry.unfit_since = None
                self.fail(
                    entry,
                    f"the run needs {world} {unit} but the live nodes have {registered}, for over {limit:g} s: add "
                    "nodes (or slots) and submit it again, or submit a plan for fewer ranks",
                )
                return
            reason += f"; the run fails if it does not fit the live nodes for {limit:g} s"
        else:
            entry.unfit_since = None
        if entry.run.waiting_for != reason:
            entry.run.waiting_for = reason
            self._records.save(entry)


def _place(world: int, idle: list[NodeRecord], kind: str) -> dict[str, list[int]] | None:
    """Ranks 0..world-1 on the idle nodes in registration order (whole nodes; a ``cuda`` run only on their
    GPUs), or None if they do not fit."""
    placement: dict[str, list[int]] = {}
    next_rank = 0
    for node in idle:
        if next_rank == world:
            break
        take = min(capacity(kind, node.slots, len(node.gpus)), world - next_rank)
        if take == 0:
            continue
        placement[node.node_id] = list(range(next_rank, next_rank + take))
        next_rank += take
    return placement if next_rank == world else None
