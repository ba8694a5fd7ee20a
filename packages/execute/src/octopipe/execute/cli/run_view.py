"""How the control CLI shows runs: a table row per run, one run in full (its losses, step times, prediction
and recoveries), or JSON with every field."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from octopipe.execute.cli.connect import out

__all__ = ["as_dict", "print_run", "print_runs"]


def as_dict(message: Any) -> dict[str, Any]:
    """A proto message as JSON values: its field names, every field present (zeros and empty lists too)."""
    result: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return result


def _run_dict(run: Any) -> dict[str, Any]:
    """A run as JSON: proto field names, the state as the table shows it (``done``, not ``RUN_STATE_DONE``)."""
    from octopipe.execute.control.common import state_name  # noqa: PLC0415 - keeps `octopipe --help` fast

    data = as_dict(run)
    data["state"] = state_name(run.state)
    return data


_RUN_HEADER = f"{'RUN':<16} {'STATE':<10} {'VERSION':>7} {'STEPS':>11} {'CHECKPOINT':>10}  NOTE"


def _run_row(run: Any) -> str:
    from octopipe.execute.control.common import state_name  # noqa: PLC0415 - keeps `octopipe --help` fast

    note = run.error or run.waiting_for or ""
    if run.adapt_report:
        note = f"{note}  adapt: {run.adapt_report}".strip()
    steps = f"{run.completed_steps}/{run.num_steps}"
    checkpoint = str(run.last_checkpoint_step) if run.last_checkpoint_step else "-"
    return f"{run.run_id:<16} {state_name(run.state):<10} {run.plan_version:>7} {steps:>11} {checkpoint:>10}  {note}"


def print_run(run: Any, as_json: bool) -> None:
    if as_json:
        out(json.dumps(_run_dict(run)))
        return
    out(_RUN_HEADER)
    out(_run_row(run))
    if run.losses:
        out(f"\n{'STEP':>6} {'LOSS':>14} {'STEP (ms)':>10}")
        steps = list(run.result_steps) or list(range(len(run.losses)))  # none from an older coordinator
        for step, loss, time_us in zip(steps, run.losses, run.step_times_us, strict=True):
            out(f"{step:>6} {loss:>14.8g} {time_us / 1e3:>10.2f}")
    out("")
    out(_prediction(run))
    for index, record in enumerate(run.recoveries, start=1):
        measured = f"{record.measured_step_us / 1e3:.2f} ms" if record.measured_step_us else "-"
        out(
            f"recovery {index} ({record.kind or 'in progress'}): {record.cause}\n"
            f"  steps {record.failed_at_step} done, resumed from {record.resumed_from_step}; lost "
            f"{record.lost_seconds:.1f} s; {record.old_plan} on {list(record.old_rank_nodes)} -> {record.new_plan} on "
            f"{list(record.new_rank_nodes)}; step predicted {record.predicted_step_us / 1e3:.2f} ms, measured {measured}"
        )


def _prediction(run: Any) -> str:
    """The predicted step time beside the measured median (the first step, warm-up, left out when others are)."""
    import statistics  # noqa: PLC0415

    if not run.predicted_step_time_us:
        return "predicted: none (submit with --profile PROFILE to have the coordinator predict the step time)"
    predicted = run.predicted_step_time_us / 1e3
    times = list(run.step_times_us)
    if not times:
        return f"predicted {predicted:.2f} ms/step; nothing measured yet"
    measured = statistics.median(times[1:] if len(times) > 1 else times) / 1e3
    skipped = ", the first left out" if len(times) > 1 else ""
    return (
        f"predicted {predicted:.2f} ms/step; measured {measured:.2f} ms (median of {max(len(times) - 1, 1)} "
        f"steps{skipped}): error {(predicted - measured) / measured:+.1%}"
    )


def print_runs(runs: list[Any], as_json: bool) -> None:
    if as_json:
        out(json.dumps([_run_dict(run) for run in runs]))
        return
    if not runs:
        out("no runs")
        return
    out(_RUN_HEADER)
    for run in runs:
        out(_run_row(run))
