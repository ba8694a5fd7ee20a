"""Tuned plans vs the library with equal layer counts on the simulated workloads (shared/benchmarks.md).

For every workload and grid point (p in {4, 8, 16}, m in {2p, 4p, 8p}) it reports simulated step
times: the zero-bubble limit (sum of all layers' F+I+W per micro-batch x m / p, no communication),
1F1B, interleaved 1F1B (2 chunks) and the best library schedule, all with equal layer counts
(decoder layers split evenly, embedding on the first stage, head + loss on the last), and the tuned
plan. Memory cap per rank: 1F1B's peak on the equal partition (the most any rank needs there), the
same for every rank; baselines over it are reported but not counted as the best library schedule.
Costs: bench/tune_workloads.py. One process, one core; the tuner's own time is reported. The grid's
tuner searches no recomputation (``recompute=("none",)``), as its library baselines save everything.

``points[]`` (issue 37): for p in ``--point-ranks`` (8, 16), m = 4p and each memory budget fraction
(1.0, 0.75, 0.5) of 1F1B's peak, the tuner searching per-stage recomputation (``none``, ``budget:0.5``,
``layers``: every policy the profile has) against the best of 1F1B and interleaved 1F1B (2 chunks) on
equal layers, each with ``layers`` recomputation on every stage where it would not fit otherwise
(``ratio_vs_best_library``); ``ratio_vs_any_library`` takes every library schedule so.

    .venv/bin/python bench/tune_grid.py [--workloads ...] [--ranks 4 8 16] [--budget 30] [--points-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from tune_workloads import WORKLOADS, workload_profile

from octopipe.ir import Recompute, with_recompute
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Estimate, OverlapModel, SimulationConfig, simulate
from octopipe.tune import (
    TuneConfig,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    tune,
    v_half,
    v_min,
    zb_h1,
    zb_h2,
    zb_v,
)

OUT = Path(__file__).parent / "results" / "tune_grid.json"
LINEAR = {"1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2, "gpipe": gpipe}
V = {"zb-v": zb_v, "v-half": v_half, "v-min": v_min, "dualpipe-v": dualpipe_v}


def equal_stages(names: list[str], num_stages: int) -> list[list[str]] | None:
    """Decoder layers split evenly (first stages one more), embedding first, head last; None if too few."""
    embed, body, head = names[0], names[1:-1], names[-1]
    if len(body) < num_stages:
        return None
    size, extra = divmod(len(body), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        end = start + size + (1 if s < extra else 0)
        stages.append(list(body[start:end]))
        start = end
    stages[0].insert(0, embed)
    stages[-1].append(head)
    return stages


def run(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> Estimate:
    """Simulate as the tuner scores: OVERLAP_F_B units (DualPipeV) cost F + B, caps reported, not raised."""
    model = CostModel.from_profile(plan, profile, overlap=OverlapModel(hidden_fraction=0.0))
    return simulate(plan, model, config=SimulationConfig(enforce_memory_caps=False, critical_path=False)).estimate


def library(
    profile: profile_pb2.Profile, p: int, m: int, cap: int, *, recompute_fallback: bool = False
) -> dict[str, dict[str, object]]:
    """Every library schedule on equal layers; with ``recompute_fallback``, one over ``cap`` is run again
    with ``layers`` recomputation on every stage (``recompute`` says which ran)."""
    names = [layer.layer_name for layer in profile.layers]
    out: dict[str, dict[str, object]] = {}
    candidates: list[tuple[str, object, int]] = [(n, f, 1) for n, f in LINEAR.items()]
    candidates += [("interleaved-1f1b", lambda p, m, **kw: interleaved_1f1b(p, 2, m, **kw), 2)]
    candidates += [(n, f, 2) for n, f in V.items()]
    for name, schedule, chunks in candidates:
        stages = equal_stages(names, p * chunks)
        if stages is None:
            continue
        try:
            plan = schedule(p, m, layer_names=stages)  # type: ignore[operator]
        except ValueError:
            continue
        estimate = run(plan, profile)
        peak = max(r.peak_memory_bytes for r in estimate.ranks)
        recompute = "none"
        if peak > cap and recompute_fallback:
            plan = with_recompute(plan, dict.fromkeys(range(len(plan.stages)), Recompute(policy="layers")))
            estimate, recompute = run(plan, profile), "layers"
            peak = max(r.peak_memory_bytes for r in estimate.ranks)
        out[name] = {"step_us": estimate.step_time_us, "peak_bytes": peak, "fits": peak <= cap, "recompute": recompute}
    return out


def points(profile: profile_pb2.Profile, name: str, ranks: list[int], fractions: list[float], budget: float) -> list:
    """The recomputation points: tuned (recomputation searched) vs the library with full-layer fallback."""
    out = []
    names = [layer.layer_name for layer in profile.layers]
    for p in ranks:
        m = 4 * p
        peak = max(
            r.peak_memory_bytes for r in run(one_f_one_b(p, m, layer_names=equal_stages(names, p)), profile).ranks
        )
        for fraction in fractions:
            cap = int(peak * fraction)
            lib = library(profile, p, m, cap, recompute_fallback=True)
            fitting = {k: v for k, v in lib.items() if v["fits"]}
            pair = {k: v for k, v in fitting.items() if k in ("1f1b", "interleaved-1f1b")}
            started = time.perf_counter()
            config = TuneConfig(num_ranks=p, num_microbatches=m, memory_cap_bytes=cap, time_budget_s=budget)
            row: dict[str, object] = {"workload": name, "p": p, "m": m, "budget_fraction": fraction, "cap_bytes": cap}
            try:
                result = tune(profile, config)
            except ValueError as exc:
                row |= {"tuned": None, "refused": str(exc), "library": lib}
                out.append(row)
                print(f"{name:14} {p:3d} {m:4d} {fraction:5.2f} refused: {str(exc)[:100]}", flush=True)
                continue
            seconds = time.perf_counter() - started
            tuned = result.estimate.step_time_us
            best_pair = min(pair, key=lambda k: pair[k]["step_us"]) if pair else None  # type: ignore[arg-type, return-value]
            best_any = min(fitting, key=lambda k: fitting[k]["step_us"]) if fitting else None  # type: ignore[arg-type, return-value]
            pair_us = float(pair[best_pair]["step_us"]) if best_pair else float("inf")  # type: ignore[arg-type]
            any_us = float(fitting[best_any]["step_us"]) if best_any else float("inf")  # type: ignore[arg-type]
            row |= {
                "library": lib,
                "best_library": best_pair,
                "best_library_recompute": pair[best_pair]["recompute"] if best_pair else None,
                "best_library_us": pair_us,
                "best_any_library": best_any,
                "best_any_library_us": any_us,
                "tuned_us": tuned,
                "tuned_plan": result.description,
                "tuned_peak_bytes": max(r.peak_memory_bytes for r in result.estimate.ranks),
                "ratio_vs_best_library": pair_us / tuned,
                "ratio_vs_any_library": any_us / tuned,
                "tuner_seconds": seconds,
                "tuner_evaluations": result.evaluations,
                "tuner_stopped": result.stopped,
            }
            out.append(row)
            label = f"{best_pair} ({row['best_library_recompute']})"
            print(
                f"{name:14} {p:3d} {m:4d} {fraction:5.2f} {label:>28} "
                f"{pair_us / 1e6:8.2f} {tuned / 1e6:8.2f} {pair_us / tuned:7.3f} {any_us / tuned:7.3f} {seconds:6.1f}  "
                f"{result.description[:90]}",
                flush=True,
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--ranks", nargs="*", type=int, default=[4, 8, 16])
    parser.add_argument("--factors", nargs="*", type=int, default=[2, 4, 8], help="m = factor x p")
    parser.add_argument("--budget", type=float, default=30.0, help="tuner time budget per point, seconds")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--point-ranks", nargs="*", type=int, default=[8, 16], help="points[]: p (m = 4p)")
    parser.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.75, 0.5], help="points[]: of 1F1B's peak")
    parser.add_argument("--points-only", action="store_true", help="only points[] (rows[] kept from --out)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(
        f"{'workload':14} {'p':>3} {'m':>4} {'frac':>5} {'best of 1F1B, int. (recompute)':>28} {'lib s':>8} "
        f"{'tuned s':>8} {'x lib':>7} {'x any':>7} {'tune s':>6}  tuned plan"
    )
    point_rows = []
    for name in args.workloads:
        point_rows += points(workload_profile(name), name, args.point_ranks, args.fractions, args.budget)
    rows: list[dict[str, object]] = []
    if args.points_only:
        rows = json.loads(args.out.read_text()).get("rows", []) if args.out.exists() else []
        args.workloads = []
    header = (
        f"{'workload':14} {'p':>3} {'m':>4} {'limit s':>8} {'1F1B s':>8} {'int. s':>8} {'best lib':>16} "
        f"{'tuned s':>8} {'x 1F1B':>7} {'x best(1F1B,int)':>16} {'x lib':>6} {'/limit':>7} {'tune s':>7}  tuned plan"
    )
    if args.workloads:
        print(header)
    for name in args.workloads:
        profile = workload_profile(name)
        work = sum(
            c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us for c in profile.layers
        )
        for p in args.ranks:
            for factor in args.factors:
                m = factor * p
                names = [layer.layer_name for layer in profile.layers]
                base_plan = one_f_one_b(p, m, layer_names=equal_stages(names, p))
                base = run(base_plan, profile)
                cap = max(r.peak_memory_bytes for r in base.ranks)
                lib = library(profile, p, m, cap)
                fitting = {k: v for k, v in lib.items() if v["fits"]}
                best_name = min(fitting, key=lambda k: fitting[k]["step_us"])  # type: ignore[arg-type, return-value]
                best_lib = float(fitting[best_name]["step_us"])  # type: ignore[arg-type]
                inter = lib.get("interleaved-1f1b")
                inter_us = float(inter["step_us"]) if inter else float("inf")  # type: ignore[arg-type]
                started = time.perf_counter()
                config = TuneConfig(
                    num_ranks=p,
                    num_microbatches=m,
                    memory_cap_bytes=cap,
                    time_budget_s=args.budget,
                    recompute=("none",),
                )
                result = tune(profile, config)
                seconds = time.perf_counter() - started
                tuned = result.estimate.step_time_us
                limit = work * m / p
                reference = min(base.step_time_us, inter_us)
                row = {
                    "workload": name,
                    "p": p,
                    "m": m,
                    "memory_cap_bytes": cap,
                    "zero_bubble_limit_us": limit,
                    "one_f_one_b_us": base.step_time_us,
                    "interleaved_us": inter_us if inter else None,
                    "interleaved_fits": bool(inter["fits"]) if inter else None,
                    "library": lib,
                    "best_library": best_name,
                    "best_library_us": best_lib,
                    "tuned_us": tuned,
                    "tuned_plan": result.description,
                    "tuned_peak_bytes": max(r.peak_memory_bytes for r in result.estimate.ranks),
                    "speedup_vs_1f1b": base.step_time_us / tuned,
                    "speedup_vs_best_of_1f1b_interleaved": reference / tuned,
                    "speedup_vs_best_library": best_lib / tuned,
                    "tuned_over_limit": tuned / limit,
                    "tuner_seconds": seconds,
                    "tuner_evaluations": result.evaluations,
                    "tuner_stopped": result.stopped,
                }
                rows.append(row)
                print(
                    f"{name:14} {p:3d} {m:4d} {limit / 1e6:8.2f} {base.step_time_us / 1e6:8.2f} "
                    f"{inter_us / 1e6:8.2f} {best_name + f' {best_lib / 1e6:.2f}':>16} {tuned / 1e6:8.2f} "
                    f"{base.step_time_us / tuned:7.3f} {reference / tuned:16.3f} {best_lib / tuned:6.3f} "
                    f"{tuned / limit:7.3f} {seconds:7.1f}  {result.description[:60]}",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "script": "bench/tune_grid.py",
        "python": sys.version.split()[0],
        "machine": platform.processor() or platform.machine(),
        "budget_s": args.budget,
        "costs": "bench/results/tune_layer_costs.json (see bench/tune_workloads.py)",
    }
    meta["load_average"] = os.getloadavg()
    meta["core"] = sorted(os.sched_getaffinity(0))
    args.out.write_text(json.dumps({"meta": meta, "points": point_rows, "rows": rows}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
