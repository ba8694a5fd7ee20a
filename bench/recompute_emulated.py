"""The memory-budget plans of ``bench/tune_grid.py``'s ``points[]``, run emulated at p = 8: executed against predicted.

For each workload and budget fraction (of 1F1B's peak saving everything): the tuned plan (each stage's
recomputation searched) and the baseline (the best predicted of 1F1B and interleaved 1F1B on equal layers,
each with ``layers`` recomputation on every stage where it would not fit otherwise), both run by the real
runtime with every computation waiting for its profiled duration (``RunOptions(emulate=profile)``,
``bench/emulated_fidelity.py``'s profiles: durations x ``--time-scale``, this machine's gloo link), and
predicted by the simulator from the same profile. Reported: each plan's predicted and emulated step, the
error, and the tuned plan's speedup over the baseline by each measure.

    .venv/bin/python bench/recompute_emulated.py [--workloads nemotronh-8b jamba-32] [--p 8] [--fractions 1 0.75 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from emulated_fidelity import scaled_profile, tuned_plan
from quiet import Environment, add_arguments, start, write_record
from tune_grid import equal_stages

from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local_many
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.ir import Recompute, recompute_of, with_recompute
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate
from octopipe.tune import interleaved_1f1b, one_f_one_b

OUT = Path(__file__).parent / "results" / "recompute_emulated.json"


def predict(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> tuple[float, int]:
    estimate = simulate(plan, local_cost_model(plan, profile)).estimate
    return estimate.step_time_us, max(r.peak_memory_bytes for r in estimate.ranks)


def baseline(profile: profile_pb2.Profile, p: int, m: int, cap: int) -> plan_pb2.Plan:
    """The best predicted of 1F1B and interleaved 1F1B (2 chunks), full-layer recomputation where needed."""
    names = [layer.layer_name for layer in profile.layers]
    found: list[tuple[float, plan_pb2.Plan]] = []
    for plan in (
        one_f_one_b(p, m, layer_names=equal_stages(names, p)),
        interleaved_1f1b(p, 2, m, layer_names=equal_stages(names, 2 * p)),
    ):
        step, peak = predict(plan, profile)
        if peak > cap:
            plan = with_recompute(plan, dict.fromkeys(range(len(plan.stages)), Recompute(policy="layers")))
            step, peak = predict(plan, profile)
        if peak <= cap:
            found.append((step, plan))
    step, plan = min(found, key=lambda item: item[0])
    plan.labels["schedule"] = "baseline"
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["nemotronh-8b", "jamba-32"])
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.75, 0.5])
    parser.add_argument("--time-scale", type=float, default=0.2)
    parser.add_argument("--tune-budget", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=OUT)
    add_arguments(parser, rounds=1, steps=3, warmup=True)
    args = parser.parse_args()
    env: Environment = start(parser, args)
    link, _ = measure_link()
    p, m = args.p, 4 * args.p
    rows: list[dict[str, Any]] = []
    for workload in args.workloads:
        profile = scaled_profile(workload, args.time_scale, link.latency_us, link.bandwidth_bytes_per_second)
        names = [layer.layer_name for layer in profile.layers]
        _, peak = predict(one_f_one_b(p, m, layer_names=equal_stages(names, p)), profile)
        for fraction in args.fractions:
            cap = int(peak * fraction)
            plans = [baseline(profile, p, m, cap), tuned_plan(profile, p, m, args.tune_budget, cap)]
            executed: dict[str, list[float]] = {plan.name: [] for plan in plans}
            for _ in range(args.rounds):
                results = run_local_many(plans, RunOptions(steps=args.steps, timeout_s=600, emulate=profile))
                for plan, result in zip(plans, results, strict=True):
                    assert result.emulated
                    executed[plan.name].extend(measured_step_times_us(result)[args.warmup :])
            row: dict[str, Any] = {"workload": workload, "p": p, "m": m, "budget_fraction": fraction, "cap_bytes": cap}
            for plan in plans:
                role = plan.labels["schedule"]
                predicted, predicted_peak = predict(plan, profile)
                median = statistics.median(executed[plan.name])
                row[role] = {
                    "plan": plan.name,
                    "recompute": [recompute_of(stage).label for stage in plan.stages],
                    "predicted_ms": predicted / 1e3,
                    "emulated_ms": median / 1e3,
                    "error": median / predicted - 1,
                    "predicted_peak_bytes": predicted_peak,
                }
            row["speedup_predicted"] = row["baseline"]["predicted_ms"] / row["tuned"]["predicted_ms"]
            row["speedup_emulated"] = row["baseline"]["emulated_ms"] / row["tuned"]["emulated_ms"]
            rows.append(row)
            print(
                f"{workload} p={p} m={m} budget {fraction:.2f}: baseline {row['baseline']['plan']} predicted "
                f"{row['baseline']['predicted_ms']:.0f} ms emulated {row['baseline']['emulated_ms']:.0f} ms "
                f"({row['baseline']['error']:+.1%}); tuned {row['tuned']['plan']} predicted "
                f"{row['tuned']['predicted_ms']:.0f} ms emulated {row['tuned']['emulated_ms']:.0f} ms "
                f"({row['tuned']['error']:+.1%}); speedup predicted {row['speedup_predicted']:.3f}x, emulated "
                f"{row['speedup_emulated']:.3f}x",
                flush=True,
            )
    errors = [abs(r[role]["error"]) for r in rows for role in ("baseline", "tuned")]
    record = {
        "source": "bench/recompute_emulated.py",
        "compute": "EMULATED: every computation waited for its profiled duration; no kernel ran",
        "time_scale": args.time_scale,
        "link": {"latency_us": link.latency_us, "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second},
        "steps_per_plan": args.steps,
        "warmup_steps": args.warmup,
        "rows": rows,
        "max_abs_error": max(errors),
        "median_abs_error": statistics.median(errors),
    }
    write_record(args.out, {**record, "environment": env.finish()})
    print(f"|error| median {record['median_abs_error']:.1%}, max {record['max_abs_error']:.1%}; written {args.out}")


if __name__ == "__main__":
    main()
