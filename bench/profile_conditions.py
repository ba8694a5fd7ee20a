"""Why layers run at another speed inside the pipeline than the profiler timed them: each condition, measured.

For one workload (standard sizes, 2 ranks, m = 8) it profiles the layers under
each condition that differs between the profiler and a rank, the profiler
pinned to the first online core:

- ``alone``: as ``pipeline.profile_reference`` does (the other core idle);
- ``beside``: while a second process, pinned to the other core, profiles the
  same layers in a loop (real compute beside, as the other rank computes);
- ``evicted``: caches evicted before each timed sample
  (``ProfilerConfig.evict_bytes``, twice the last-level cache), as an action
  that runs after other micro-batches' actions may start;
- ``lockstep``: ``runtime.lockstep.profile_in_lockstep``, the profiler the
  fidelity bench uses: one profiler per rank, pinned to the rank's core, each
  timed sample started in all of them together;
- ``stages`` (models with a layer list): each stage of the 2-stage equal
  partition timed whole against the sum of its layers' times (does a stage
  cost what its layers add up to?).

Then it runs 1F1B and ZB-H1 (2 ranks pinned to 2 distinct cores, interleaved,
``--rounds`` rounds of ``--steps`` steps) and prints, for each profile, the
predicted step's error and measured / profiled time per (stage, action kind)
from the recorded timelines. The condition whose factors sit nearest 1 is what
the pipeline sees; the JSON records the host's CPU, load and cores.

    .venv/bin/python bench/profile_conditions.py [--workload llama-8] [--rounds 3] [--steps 3] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from quiet import add_arguments, start, write_record

from octopipe.capture import StageModule, pipeline_spec
from octopipe.execute.runtime import RunOptions, run_local_many, workload_reference
from octopipe.execute.runtime.lockstep import profile_in_lockstep
from octopipe.execute.runtime.measure import timelines_to_proto
from octopipe.execute.runtime.models import build_model
from octopipe.execute.runtime.pinning import online_cpus
from octopipe.execute.runtime.pipeline import compare, layer_names, profile_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import durations_from_timelines, local_cost_model
from octopipe.transform import ProfilerConfig, profile_stages
from octopipe.tune import DEFAULT_SCHEDULES, equal_partition

M, P = 8, 2
SCHEDULES = ("1f1b", "zb-h1")
#: evicting with twice the last-level cache replaces every line it held
FALLBACK_CACHE_BYTES = 64 * 2**20


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0 (sysfs), or FALLBACK_CACHE_BYTES where sysfs does not say."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").exists() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
    return max(sizes, default=FALLBACK_CACHE_BYTES)


def reference_of(args: argparse.Namespace) -> plan_pb2.ModelReference:
    return workload_reference(args.workload, tiny=True, sequence=16) if args.tiny else workload_reference(args.workload)


def neighbour_loop(args: argparse.Namespace) -> None:
    """The ``beside`` neighbour: profile the same layers, pinned to its core, until killed."""
    os.sched_setaffinity(0, {args.neighbour_core})
    reference = reference_of(args)
    while True:
        profile_reference(reference, num_microbatches=M, num_ranks=P, repeats=3)


def profile_beside(args: argparse.Namespace, core: int) -> profile_pb2.Profile:
    command = [sys.executable, __file__, "--workload", args.workload, "--neighbour-core", str(core)]
    neighbour = subprocess.Popen([*command, *(["--tiny"] if args.tiny else [])], stdout=subprocess.DEVNULL)
    try:
        time.sleep(3.0)  # past its imports: computing by the time the timed samples start
        if neighbour.poll() is not None:
            raise SystemExit(f"the neighbour process exited early with code {neighbour.returncode}")
        return profile_reference(reference_of(args), num_microbatches=M, num_ranks=P)
    finally:
        neighbour.kill()
        neighbour.wait(timeout=30)


def stage_sums(reference: plan_pb2.ModelReference) -> list[dict[str, Any]] | None:
    """Each stage of the equal 2-stage partition timed whole vs the sum of its layers (None: no layer list)."""
    built = build_model(reference, seed=0)
    if built.input_names is not None:
        return None
    inputs, targets = built.batch(0)
    size = inputs.shape[0] // M
    x, y = inputs[:size], targets[:size]
    spec = pipeline_spec(built.model)
    cut = len(equal_partition(list(spec.names), P)[0])
    config = ProfilerConfig(repeats=5)
    layers, examples, names = [], [], []
    with torch.no_grad():
        h = x
        for index, layer in enumerate(spec.layers):
            last = index == len(spec.layers) - 1
            stage = StageModule(
                built.model, [layer], stage_index=index, num_stages=len(spec.layers), loss=spec.loss if last else None
            )
            layers.append(stage)
            examples.append([h, y] if last else [h])
            names.append(layer.name)
            h = stage(*examples[-1])
        first = StageModule(built.model, list(spec.layers[:cut]), stage_index=0, num_stages=P, loss=None)
        second = StageModule(built.model, list(spec.layers[cut:]), stage_index=1, num_stages=P, loss=spec.loss)
        middle = first(x)
    each = profile_stages(layers, examples, names, microbatch_size=size, config=config)
    whole = profile_stages(
        [first, second], [[x], [middle, y]], ["stage0", "stage1"], microbatch_size=size, config=config
    )
    fields = (
        "forward_duration_us",
        "backward_input_duration_us",
        "backward_weight_duration_us",
        "full_backward_duration_us",
    )
    rows: list[dict[str, Any]] = []
    for index, (start_at, end_at) in enumerate(((0, cut), (cut, len(spec.layers)))):
        part = each.layers[start_at:end_at]
        summed = {f: sum(getattr(c, f) for c in part) for f in fields}
        timed = {f: getattr(whole.layers[index], f) for f in fields}
        for times in (summed, timed):  # a first stage computes no input gradient: its I's work is in W
            times["I+W"] = times["backward_input_duration_us"] + times["backward_weight_duration_us"]
        rows.append(
            {
                "stage": index,
                "layers_sum_us": summed,
                "whole_us": timed,
                "whole_over_sum": {f: timed[f] / summed[f] for f in summed if summed[f] > 0},
            }
        )
    return rows


def factors(plan: plan_pb2.Plan, profile: profile_pb2.Profile, runs: list[Any]) -> dict[str, float]:
    """Measured (timelines, warm-up steps left out) / profiled time per (stage, action kind)."""
    costs = local_cost_model(plan, profile)
    timelines = [t for run in runs for t in timelines_to_proto(run) if t.step > 0]
    out = {}
    for (stage, kind), measured in sorted(
        durations_from_timelines(timelines).items(), key=lambda x: (x[0][0], x[0][1].code)
    ):
        predicted = costs.stages[stage].duration_us(kind)
        if predicted > 0:
            out[f"{stage}{kind.code}"] = measured / predicted
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="llama-8")
    parser.add_argument("--neighbour-core", type=int, help=argparse.SUPPRESS)  # the ``beside`` child
    add_arguments(parser, rounds=3, steps=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "profile_conditions.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.neighbour_core is not None:
        neighbour_loop(args)
        return
    env = start(parser, args)
    cores = online_cpus()
    if len(cores) < 2:
        raise SystemExit(f"needs 2 online cores, found {cores}")
    os.sched_setaffinity(0, {cores[0]})
    reference = reference_of(args)
    evict = 2 * last_level_cache_bytes()
    stages = stage_sums(reference)
    profiles = {
        "alone": profile_reference(reference, num_microbatches=M, num_ranks=P),
        "beside": profile_beside(args, cores[1]),
        "evicted": profile_reference(reference, num_microbatches=M, num_ranks=P, evict_bytes=evict),
        "lockstep": profile_in_lockstep(reference, num_microbatches=M, num_ranks=P),
    }
    os.sched_setaffinity(0, set(cores))  # the ranks pin themselves; the launcher does not inherit one core
    names = layer_names(reference)
    by_name = {entry.name: entry for entry in DEFAULT_SCHEDULES}
    plans = []
    for schedule in SCHEDULES:
        plan = by_name[schedule].generate(P, M, layer_names=equal_partition(names, P))
        plan.model.CopyFrom(reference)
        plans.append(plan)
    runs = run_local_many(plans * args.rounds, RunOptions(steps=args.steps, timeout_s=900.0))
    env.record(runs[0].cores)
    rows: list[dict[str, Any]] = []
    print(f"\nprofile conditions, {args.workload}: measured / profiled time per stage and action kind")
    print(f"{'plan':<7} {'profile':<8} {'pred ms':>8} {'meas ms':>8} {'err':>7}  factors")
    for index, plan in enumerate(plans):
        mine = runs[index :: len(plans)]
        for condition, profile in profiles.items():
            got = compare(plan, profile, mine)
            seen = factors(plan, profile, mine)
            error = (got.predicted_step_us - got.measured_step_us) / got.measured_step_us
            rows.append(
                {
                    "plan": plan.labels["schedule"],
                    "profile": condition,
                    "predicted_ms": got.predicted_step_us / 1e3,
                    "measured_ms": got.measured_step_us / 1e3,
                    "replay_ms": got.replay_step_us / 1e3,
                    "signed_error": error,
                    "measured_over_profiled": seen,
                }
            )
            shown = " ".join(f"{k} {v:.3f}" for k, v in seen.items())
            print(
                f"{plan.labels['schedule']:<7} {condition:<8} {got.predicted_step_us / 1e3:>8.0f} {got.measured_step_us / 1e3:>8.0f} {error:>+7.1%}  {shown}"
            )
    summary = {c: statistics.fmean(abs(r["signed_error"]) for r in rows if r["profile"] == c) for c in profiles}
    print("mean |step error| per profile: " + ", ".join(f"{c} {e:.1%}" for c, e in summary.items()))
    if stages is not None:
        for row in stages:
            print(
                f"stage {row['stage']} timed whole / sum of its layers: "
                + " ".join(f"{f.split('_duration')[0]} {v:.3f}" for f, v in row["whole_over_sum"].items())
            )
    write_record(
        args.out,
        {
            "workload": args.workload,
            "sizes": "tiny" if args.tiny else "standard",
            "rounds": args.rounds,
            "steps": args.steps,
            "evict_bytes": evict,
            "mean_abs_step_error": summary,
            "rows": rows,
            "stages_whole_over_layers": stages,
            "environment": env.finish(),
        },
    )


if __name__ == "__main__":
    main()
