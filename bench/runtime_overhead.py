"""Runtime overhead per action: the measured step against the simulator replaying the measured actions.

llama-8 at the tiny sizes, 2 local gloo ranks (one pinned core each), m = 8,
1F1B and ZB-H1 with equal layer counts. Each run records every action; the
simulator is then fed the measured per-action durations (median per stage and
kind, warm-up step left out) and the local gloo link, and replays the step.
What the measured step has beyond the replay is the runtime's own overhead:
the interpreter, the communication layer, bookkeeping. Reported per plan:
the median measured step, the replay, their ratio and the overhead per action
(the difference over the busiest rank's action count).

The script uses only APIs that older versions have too, so the same file
measures an older checkout (``PYTHONPATH`` pointing at its sources) for a
before/after comparison; ``--label`` names the version, and results are added
to ``bench/results/runtime_overhead.json`` under that label. Alternate the
versions (before, after, before, after) so both see the same machine.

    .venv/bin/python bench/runtime_overhead.py --label after [--steps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from octopipe.execute.runtime import (
    RunOptions,
    build_model,
    measured_step_times_us,
    run_local_many,
    timelines_to_proto,
    workload_reference,
)
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import LOCAL_GLOO_LINK, CostModel, StageCost, durations_from_timelines, simulate
from octopipe.tune import equal_partition, one_f_one_b, zb_h1

RESULTS = Path(__file__).resolve().parent / "results" / "runtime_overhead.json"
M = 8


def plans() -> list[plan_pb2.Plan]:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2 * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    out = [one_f_one_b(2, M, layer_names=equal_partition(names, 2)), zb_h1(2, M, layer_names=equal_partition(names, 2))]
    for plan in out:
        plan.model.CopyFrom(reference)
    return out


def measure(steps: int) -> list[dict[str, Any]]:
    rows = []
    chosen = plans()
    runs = run_local_many(chosen, RunOptions(steps=steps, timeout_s=120))
    for plan, run in zip(chosen, runs, strict=True):
        # where the ranks ran, as they report it (versions before RunResult.cores: derived, below)
        ran_on = {str(rank): cores for rank, cores in getattr(run, "cores", {}).items()}
        times = measured_step_times_us(run)[1:]  # the first step warms up
        timelines = [t for t in timelines_to_proto(run) if t.step > 0]
        costs = CostModel.uniform(num_stages=len(plan.stages), stage=StageCost(), link=LOCAL_GLOO_LINK)
        replay = simulate(plan, dataclasses.replace(costs, durations_us=durations_from_timelines(timelines)))
        measured = statistics.median(times)
        replayed = replay.estimate.step_time_us
        actions = max(len(program.actions) for program in plan.ranks)
        rows.append(
            {
                "plan": plan.name,
                "measured_step_ms": measured / 1e3,
                "measured_steps_ms": [t / 1e3 for t in times],
                "replay_step_ms": replayed / 1e3,
                "measured_over_replay": measured / replayed,
                "overhead_per_action_us": (measured - replayed) / actions,
                "actions_busiest_rank": actions,
                "rank_cores_reported": ran_on,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="names the version measured (e.g. before, after)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"this process is pinned to cores {cores}: the 2 ranks need 2 distinct cores")
    load_before = os.getloadavg()
    started = time.time()
    rows = measure(args.steps)
    record = {
        "label": args.label,
        "time": started,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        # the workers pin rank r to cores[r % len(cores)] of this process's mask
        "rank_cores": {str(rank): cores[rank % len(cores)] for rank in range(2)},
        "machine": platform.machine(),
        "rows": rows,
    }
    print(f"{args.label}: load {load_before[0]:.2f}, ranks on cores {record['rank_cores']}")
    print(f"{'plan':<14}{'measured ms':>13}{'replay ms':>11}{'ratio':>8}{'us/action':>11}")
    for row in rows:
        print(
            f"{row['plan']:<14}{row['measured_step_ms']:>13.2f}{row['replay_step_ms']:>11.2f}"
            f"{row['measured_over_replay']:>8.3f}{row['overhead_per_action_us']:>11.1f}"
        )
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
    existing["runs"].append(record)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    main()
