"""The coordinator's closed loop: after a run's first measured steps, re-tune it from its measured timelines
(``tune.retune``) and switch every node to the better plan at a step boundary; report the measured gain."""

from __future__ import annotations

import threading
import time

from octopipe.execute.control.coordinator.records import Records, RunRecord
from octopipe.execute.control.pushes import RunPusher
from octopipe.ir import mesh_spec
from octopipe.node.v1 import node_pb2
from octopipe.tune.retune import measured_gain, retune

__all__ = ["DEFAULT_ADAPT_AFTER", "MIN_ADAPT_GAIN", "ClosedLoop"]

#: closed loop: re-tune after this many completed steps unless the submission says otherwise
DEFAULT_ADAPT_AFTER = 3
#: switch only when the re-tuned plan is predicted at least this much faster
MIN_ADAPT_GAIN = 1.03
#: at the end of an adaptive run, wait at most this long for the last metrics (the streams are a moment behind)
_METRICS_GRACE_S = 5.0


class ClosedLoop:
    """Starts one re-tuning thread per adaptive run once it has measured enough steps."""

    def __init__(self, records: Records, pusher: RunPusher) -> None:
        self._records = records
        self._pusher = pusher

    def metrics_complete(self, entry: RunRecord) -> bool:
        """Whether every rank's every step has arrived (waits at most a few seconds after the nodes say done)."""
        entry.done_seen_at = entry.done_seen_at or time.monotonic()
        world = mesh_spec(entry.plan).world_size
        expected = world * (entry.run.num_steps - (entry.run.last_checkpoint_step if entry.run.resumes else 0))
        return len(entry.metrics) >= expected or time.monotonic() - entry.done_seen_at > _METRICS_GRACE_S

    def report_gain(self, entry: RunRecord) -> None:
        """Add the measured median step before and after the switch to the run's report (lock held)."""
        gain = measured_gain(entry.metrics)
        if gain is not None:
            before, after = gain
            entry.run.adapt_report += (
                f"; measured median step {before / 1e3:.1f} ms before the switch, {after / 1e3:.1f} ms after "
                f"(x{before / after:.3f})"
            )

    @staticmethod
    def _measured_steps(entry: RunRecord) -> int:
        """Steps every rank has reported metrics for, before any plan switch."""
        world = mesh_spec(entry.plan).world_size
        return sum(1 for m in entry.metrics if m.plan_switches == 0) // world

    def check(self) -> None:
        """Start re-tuning every adaptive run that is running and has measured enough steps."""
        records = self._records
        with records.lock:
            ready = [
                e
                for e in records.runs.values()
                if e.submit.adapt
                and not e.adapt_phase
                and e.run.state == node_pb2.RUN_STATE_RUNNING
                and self._measured_steps(e) >= (e.submit.adapt_after_steps or DEFAULT_ADAPT_AFTER)
            ]
            for entry in ready:
                entry.adapt_phase = "busy"
        for entry in ready:
            threading.Thread(target=self._adapt, args=(entry,), name="octopipe-adapt", daemon=True).start()

    def _adapt(self, entry: RunRecord) -> None:
        """Re-tune from the measured steps (the first skipped) and switch when the gain is worth it."""
        records = self._records
        try:
            with records.lock:
                plan = entry.plan
                timelines = [m.timeline for m in entry.metrics if m.step >= 1 and m.plan_switches == 0]
            result = retune(plan, entry.submit.profile, timelines)
            report = (
                f"after {len(timelines) // mesh_spec(plan).world_size} measured steps (the first skipped): running "
                f"{plan.labels.get('schedule', plan.name)} predicted {result.current_us / 1e3:.1f} ms/step with "
                f"measured costs; best {result.name} {result.best_us / 1e3:.1f} ms (x{result.predicted_gain:.3f})"
            )
            with records.lock:
                if entry.run.state != node_pb2.RUN_STATE_RUNNING:
                    return
                switch = result.predicted_gain >= MIN_ADAPT_GAIN and result.name != "current"
                if switch:
                    entry.run.plan_version += 1
                    result.plan.version = entry.run.plan_version
                    addresses = {n: records.nodes[n].address for n in entry.placement if n in records.nodes}
                    placement = dict(entry.placement)
                entry.run.adapt_report = report + ("; switching" if switch else "; kept the running plan")
                records.save(entry)
            if switch:
                error = self._pusher.switch(entry.run, result.plan, placement, addresses)
                with records.lock:
                    if error:
                        entry.run.adapt_report += f"; switch failed: {error}"
                    else:
                        entry.plan = result.plan
                        entry.submit.plan.CopyFrom(result.plan)
                        entry.run.predicted_step_time_us = result.best_us  # with the calibrated costs
                    records.save(entry)
            records.log.info("adapted", run=entry.run.run_id, report=entry.run.adapt_report)
        except Exception as exc:  # the run goes on with its plan
            records.log.exception("adapt_failed", run=entry.run.run_id)
            with records.lock:
                entry.run.adapt_report = f"re-tuning failed: {exc}"
                records.save(entry)
        finally:
            entry.adapt_phase = "done"
