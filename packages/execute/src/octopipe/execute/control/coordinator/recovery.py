"""Self-healing runs: what the coordinator does when a run with an automatic recovery policy fails.

A run submitted with ``recovery.automatic`` that loses a node (missed
heartbeats: a killed daemon, a cut link), a rank (a node reports the run
failed) or its coordinator (restored and not reported by its nodes) is not
failed: it goes RECOVERING. The coordinator stops what is left of it, and once
the failed attempt's ranks are gone and the live nodes are known (a settle time
of one heartbeat timeout, counted again after a coordinator restart):

- if the idle live nodes have the slots of the run's plan, it runs the same
  plan on them (``kind`` "same plan": a rank crash, a replacement node);
- else it waits up to ``wait_for_replacement_s`` (wall clock from the failure,
  so a restart does not extend it) for a replacement;
- then it re-tunes partition x placement x schedule for the slots that remain
  (``tune.replan``: the submission's profile calibrated by the run's measured
  steps, the same micro-batch count, ``memory_cap_bytes``), re-verifies the plan
  (``submission.check_plan``) and resumes.

Either way the run is queued again at a higher plan version from its last
complete checkpoint (the newest committed ``step-<n>``; none: from step 0, the
same weights). Each recovery is a ``Recovery`` on the run: the cause, the steps
lost, the old and new plan and ranks, the time lost until the healed run's first
step, and its predicted and measured step. All of it is in the run's record, so
a coordinator restarted during a recovery carries it on. A run that fails more
than ``max_recoveries`` times, has no profile to re-plan with, or whose plan has
data-parallel replicas (its checkpoints are per replica) and did not get its
slots back in time, fails with the reason.
"""

from __future__ import annotations

import threading
import time

from octopipe.execute.checkpoint_files import latest_checkpoint
from octopipe.execute.control.common import TERMINAL_STATES
from octopipe.execute.control.coordinator.records import CoordinatorConfig, Records, RunRecord
from octopipe.execute.control.coordinator.results import predicted_step_us, recovered_step_us
from octopipe.execute.control.pushes import RunPusher
from octopipe.execute.control.submission import check_plan, profile_problem
from octopipe.execute.devices import capacity, is_gpu
from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.tune import replan

__all__ = ["DEFAULT_MAX_RECOVERIES", "Recoveries", "plan_summary"]

#: a policy's max_recoveries of 0 means this many
DEFAULT_MAX_RECOVERIES = 3
#: the tuner's time budget when it re-plans a run
REPLAN_BUDGET_S = 20.0


def plan_summary(plan: plan_pb2.Plan) -> str:
    """A plan in words: its schedule, stages, ranks and micro-batches."""
    schedule = plan.labels.get("schedule") or plan.name or "plan"
    sizes = "/".join(str(len(stage.layer_names)) for stage in plan.stages)
    return (
        f"{schedule}: {len(plan.stages)} stages ({sizes} layers) on {mesh_spec(plan).world_size} ranks, "
        f"m={plan.num_microbatches}"
    )


class Recoveries:
    """Starts recoveries (``begin``, instead of failing a run) and carries them on every loop tick (``check``)."""

    def __init__(self, records: Records, pusher: RunPusher, config: CoordinatorConfig) -> None:
        self._records = records
        self._pusher = pusher
        self._config = config
        self._started = time.monotonic()

    def begin(self, entry: RunRecord, cause: str) -> str:
        """Recover ``entry`` instead of failing it (lock held): '' when recovering, else why not (the run must
        fail, the reason added to its error)."""
        policy, run = entry.submit.recovery, entry.run
        if not policy.automatic or run.state in TERMINAL_STATES:
            return "no automatic recovery"
        limit = policy.max_recoveries or DEFAULT_MAX_RECOVERIES
        if len(run.recoveries) >= limit:
            return f"gave up after {limit} automatic recoveries"
        if run.state == node_pb2.RUN_STATE_RECOVERING:
            return ""  # already recovering: a second report of the same failure
        # heartbeats lag the ranks: a checkpoint may already hold steps the coordinator has not heard of
        done = max(run.completed_steps, latest_checkpoint(run.checkpoint_dir) if run.checkpoint_dir else 0)
        record = run.recoveries.add(cause=cause, failed_at_step=done, old_plan=plan_summary(entry.plan))
        record.old_rank_nodes.extend(run.rank_nodes)
        record.failed_at.GetCurrentTime()
        entry.recovering_since = time.monotonic()
        entry.failed_nodes, entry.failed_at = dict(entry.placement), time.monotonic()
        targets = self._records.addresses(entry.placement, alive_only=True)
        entry.placement = {}
        self._records.set_state(entry, node_pb2.RUN_STATE_RECOVERING, cause)
        self._pusher.stop_async(run.run_id, targets, f"recovering: {cause}")
        self._records.log.warning("run_recovering", run=run.run_id, cause=cause, recovery=len(run.recoveries))
        return ""

    def name_cause(self, entry: RunRecord, cause: str) -> None:
        """A lost node found after the run began recovering through another report: name it (lock held)."""
        if entry.run.state == node_pb2.RUN_STATE_RECOVERING and entry.run.recoveries:
            record = entry.run.recoveries[-1]
            if cause not in record.cause:
                record.cause = f"{cause}; first report: {record.cause}"

    # -- every tick ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Carry every recovering run one step on: wait, resume with the same plan, or re-plan."""
        records, now = self._records, time.monotonic()
        settle = self._config.heartbeat_timeout_s
        with records.lock:
            recovering = [
                e for e in records.runs.values() if e.run.state == node_pb2.RUN_STATE_RECOVERING and not e.replanning
            ]
            for entry in recovering:
                since = max(entry.recovering_since or now, self._started)
                if now - since >= settle:
                    self._decide(entry)

    def _decide(self, entry: RunRecord) -> None:
        records, run, policy = self._records, entry.run, entry.submit.recovery
        record = run.recoveries[-1]
        stopping = sorted(
            n
            for n in entry.failed_nodes
            if (node := records.nodes.get(n)) is not None
            and node.alive
            and node.status.run_id == run.run_id
            and node.status.state not in TERMINAL_STATES
        )
        if stopping:
            self._waiting(entry, f"recovering: waiting for the failed attempt's ranks to stop on {', '.join(stopping)}")
            return
        kind = entry.submit.device
        busy = {n for e in records.runs.values() if e.run.state not in TERMINAL_STATES for n in e.placement}
        # only nodes heard from lately: one that died with the run may not be declared dead yet
        fresh = max(2 * self._config.heartbeat_interval_s, self._config.heartbeat_timeout_s / 2)
        now = time.monotonic()
        free = sum(
            capacity(kind, n.slots, len(n.gpus))
            for n in records.nodes.values()
            if n.alive and n.node_id not in busy and now - n.last_seen <= fresh
        )
        gone = [
            n
            for n in dict.fromkeys(record.old_rank_nodes)
            if (node := records.nodes.get(n)) is None or not node.alive or now - node.last_seen > fresh
        ]
        if gone and f"node {gone[0]}" not in record.cause:  # e.g. after a restart, which forgot the node lost
            record.cause += f"; gone since: node {', node '.join(gone)}"
        world = mesh_spec(entry.plan).world_size
        if free >= world:
            self._resume(entry, entry.plan, "same plan", run.predicted_step_time_us)
            return
        waited = time.time() - record.failed_at.ToNanoseconds() / 1e9
        unit = "GPU slots" if is_gpu(kind or "cpu") else "slots"
        if waited < policy.wait_for_replacement_s:
            self._waiting(
                entry,
                f"recovering: waiting up to {policy.wait_for_replacement_s:g} s for {world} {unit} ({free} idle), "
                "then re-planning for the slots that remain",
            )
            return
        problem = ""
        if mesh_spec(entry.plan).dp > 1:
            problem = "its plan has data-parallel replicas, whose checkpoints resume only on the same mesh"
        elif not entry.submit.profile.layers:
            problem = "the submission has no profile to re-plan with (submit it with the plan's profile)"
        if problem:
            self._give_up(entry, f"cannot re-plan for {free} {unit}: {problem}")
            return
        limit = self._config.never_fits_after_s
        if free == 0:
            if waited > limit:
                self._give_up(entry, f"no live {unit} to recover onto for {limit:g} s")
            else:
                self._waiting(entry, f"recovering: no idle {unit}; waiting up to {limit:g} s for a node")
            return
        entry.replanning = True
        self._waiting(entry, f"recovering: re-planning for {free} {unit}")
        timelines = [m.timeline for m in self._records.metrics_of(entry) if m.plan_version == run.plan_version]
        threading.Thread(
            target=self._replan, args=(entry, free, timelines), name="octopipe-replan", daemon=True
        ).start()

    def _replan(self, entry: RunRecord, slots: int, timelines: list[profile_pb2.RankTimeline]) -> None:
        records = self._records
        try:
            cap = entry.submit.recovery.memory_cap_bytes or None
            result = replan(entry.plan, entry.submit.profile, timelines, slots, memory_cap_bytes=cap,
                            time_budget_s=REPLAN_BUDGET_S)  # fmt: skip
            plan = result.plan
            problem = check_plan(plan, num_steps=entry.run.num_steps, like=entry.plan)
            problem = problem or profile_problem(plan, entry.submit.profile)
        except Exception as exc:  # the tuner found nothing that fits, or failed
            plan, problem = None, f"{type(exc).__name__}: {exc}"
        with records.lock:
            entry.replanning = False
            if entry.run.state != node_pb2.RUN_STATE_RECOVERING:
                return  # cancelled meanwhile
            if plan is None or problem:
                self._give_up(entry, f"re-planning for {slots} ranks failed: {problem}")
                return
            self._resume(entry, plan, "replan", result.estimate.step_time_us)

    # -- outcomes (lock held) ---------------------------------------------------------------------
    def _resume(self, entry: RunRecord, plan: plan_pb2.Plan, kind: str, predicted_us: float) -> None:
        run = entry.run
        step = latest_checkpoint(run.checkpoint_dir) if run.checkpoint_dir else 0
        record = run.recoveries[-1]
        record.kind, record.new_plan, record.resumed_from_step = kind, plan_summary(plan), step
        record.predicted_step_us = predicted_us if kind == "replan" else predicted_step_us(plan, entry.submit.profile)
        if plan is not entry.plan:
            entry.plan = plan
            entry.submit.plan.CopyFrom(plan)
        run.predicted_step_time_us = record.predicted_step_us
        run.last_checkpoint_step = step
        run.completed_steps = step
        run.plan_version += 1
        record.plan_version = run.plan_version
        run.resumes += 1
        run.waiting_for = ""
        run.error = ""
        entry.recovering_since = None
        entry.failed_nodes = {}
        self._records.set_state(entry, node_pb2.RUN_STATE_QUEUED)
        self._records.log.info("run_recovered", run=run.run_id, kind=kind, from_step=step, plan=record.new_plan)

    def _waiting(self, entry: RunRecord, reason: str) -> None:
        if entry.run.waiting_for != reason:
            entry.run.waiting_for = reason
            self._records.save(entry)

    def _give_up(self, entry: RunRecord, reason: str) -> None:
        record = entry.run.recoveries[-1]
        entry.run.waiting_for = ""
        entry.recovering_since = None
        self._records.set_state(entry, node_pb2.RUN_STATE_FAILED, f"{record.cause}; recovery failed: {reason}")

    # -- after the resume -------------------------------------------------------------------------
    def placed(self, entry: RunRecord) -> None:
        """The healed run was pushed (lock held): when, and onto which nodes."""
        if entry.run.recoveries and not entry.run.recoveries[-1].HasField("resumed_at"):
            record = entry.run.recoveries[-1]
            record.resumed_at.GetCurrentTime()
            record.new_rank_nodes.extend(entry.run.rank_nodes)

    def progressed(self, entry: RunRecord) -> None:
        """The run completed steps (lock held): the first step after a recovery ends its lost time."""
        if not entry.run.recoveries:
            return
        record = entry.run.recoveries[-1]
        if (
            record.HasField("resumed_at")
            and not record.lost_seconds
            and entry.run.completed_steps > record.resumed_from_step
        ):
            record.lost_seconds = time.time() - record.failed_at.ToNanoseconds() / 1e9

    def finished(self, entry: RunRecord) -> None:
        """The run is done (lock held): each recovery's measured step, from the attempt that followed it."""
        metrics = self._records.metrics_of(entry)
        for record in entry.run.recoveries:
            if not record.measured_step_us and record.plan_version:
                record.measured_step_us = recovered_step_us(metrics, record.plan_version)
