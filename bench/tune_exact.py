"""The heuristics vs the exact MILP (HiGHS) on small instances: gap to optimal and time of each.

Instances: a fixed partition and placement (one stage per rank, and the V shape), p in {2, 3, 4},
m in {p, 2p}, stage costs drawn from the per-layer-type costs of bench/tune_workloads.py (each stage
one layer type, seeded), memory cap per rank = 1F1B's peak, free links (the MILP treats
communication as a pure delay; the simulator also serialises it, so they agree only on free links).
The heuristic is the best of the list scheduler's policies and the library schedules of the
placement that fit the cap (what the tuner's schedule phase does); its time is that whole phase.

    .venv/bin/python bench/tune_exact.py [--time-limit 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Literal

from tune_workloads import TABLE

from octopipe.ir import Action, add_p2p_actions, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import CostModel, Link, SimulationConfig, StageCost, StageSpec, build_plan, simulate
from octopipe.tune import ListSchedulerConfig, exact_schedule, list_schedule, one_f_one_b, v_placement, zb_h1, zb_h2
from octopipe.tune.vshape import v_half, v_min, zb_v

OUT = Path(__file__).parent / "results" / "tune_exact.json"
PRIORITIES: tuple[Literal["backward", "forward"], ...] = ("backward", "forward")
Order = dict[int, list[Action]]
TYPES = ("mamba2", "attention", "relu2", "attention+swiglu", "mamba+moe", "head")


def stage_costs(num_stages: int, seed: int) -> tuple[StageCost, ...]:
    table = json.loads(TABLE.read_text())["types"]
    rng = random.Random(seed)
    out = []
    for _ in range(num_stages):
        row = table[rng.choice(TYPES)]
        saved = int(row["activation_saved_bytes"])
        out.append(
            StageCost(
                forward_us=round(row["forward_duration_us"] / 1e3, 1),  # ms as us: the MILP is scale-free
                backward_input_us=round(row["backward_input_duration_us"] / 1e3, 1),
                backward_weight_us=round(row["backward_weight_duration_us"] / 1e3, 1),
                activation_bytes=saved,
                freed_by_backward_input_bytes=min(saved, int(row["activation_freed_by_backward_input_bytes"])),
            )
        )
    return tuple(out)


def plan_of(compute: Order, placement: list[int], m: int, caps: dict[int, int]) -> plan_pb2.Plan:
    stages = [StageSpec(rank=r) for r in placement]
    return build_plan(
        stages=stages,
        actions=add_p2p_actions(compute, dict(enumerate(placement))),
        num_microbatches=m,
        memory_caps=caps,
    )


def heuristic(
    costs: CostModel, placement: list[int], m: int, caps: dict[int, int], v: bool
) -> tuple[float, str, Order]:
    config = SimulationConfig(enforce_memory_caps=False, critical_path=False)
    p = max(placement) + 1
    best: tuple[float, str, Order] = (float("inf"), "", {})
    policies = [
        ListSchedulerConfig(priority=priority, reserve_memory=reserve)
        for priority in PRIORITIES
        for reserve in (True, False)
    ]
    if not v:
        policies += [replace_ahead(policy, p) for policy in policies if policy.reserve_memory]
    orders = []
    for policy in policies:
        try:
            orders.append(
                (f"list({policy.priority})", list_schedule(costs, placement, m, memory_caps=caps, config=policy))
            )
        except ValueError:
            continue
    library = (
        {"zb-v": zb_v, "v-half": v_half, "v-min": v_min} if v else {"1f1b": one_f_one_b, "zb-h1": zb_h1, "zb-h2": zb_h2}
    )
    for name, schedule in library.items():
        try:
            plan = schedule(p, m)
        except ValueError:
            continue
        orders.append((name, {r: [a for a in acts if a.kind.is_compute] for r, acts in rank_actions(plan).items()}))
    for name, compute in orders:
        estimate = simulate(plan_of(compute, placement, m, caps), costs, config=config).estimate
        if estimate.fits and estimate.step_time_us < best[0]:
            best = (estimate.step_time_us, name, compute)
    return best


def replace_ahead(policy: ListSchedulerConfig, p: int) -> ListSchedulerConfig:
    from dataclasses import replace  # noqa: PLC0415

    return replace(policy, max_ahead=[p - r for r in range(p)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=60.0, help="HiGHS time limit per instance, seconds")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    rows = []
    print(
        f"{'placement':9} {'p':>2} {'m':>2} {'heuristic':>10} {'exact':>9} {'bound':>9} {'gap':>7} {'proven':>6} "
        f"{'heur s':>7} {'exact s':>8}  heuristic"
    )
    for shape in ("linear", "v"):
        for p in (2, 3, 4):
            for m in (p, 2 * p):
                placement = v_placement(p) if shape == "v" else list(range(p))
                costs = CostModel(stages=stage_costs(len(placement), seed=p * 10 + m), default_link=Link())
                base = simulate(
                    plan_of(
                        {
                            r: [a for a in acts if a.kind.is_compute]
                            for r, acts in rank_actions(one_f_one_b(p, m)).items()
                        },
                        list(range(p)),
                        m,
                        {},
                    ),
                    CostModel(stages=costs.stages[:p], default_link=Link()),
                ).estimate
                caps = dict.fromkeys(range(p), max(r.peak_memory_bytes for r in base.ranks))
                if shape == "v":  # the V's own 1F1B-equivalent: ZB-V's peak (p micro-batches per rank) on these costs
                    zbv = {r: [a for a in acts if a.kind.is_compute] for r, acts in rank_actions(zb_v(p, m)).items()}
                    peak = simulate(plan_of(zbv, placement, m, {}), costs).estimate
                    caps = dict.fromkeys(range(p), max(r.peak_memory_bytes for r in peak.ranks))
                started = time.perf_counter()
                heur, heur_name, order = heuristic(costs, placement, m, caps, shape == "v")
                heur_s = time.perf_counter() - started
                exact = exact_schedule(
                    costs, placement, m, memory_caps=caps, time_limit_s=args.time_limit, initial=order
                )
                best = min(exact.estimate.step_time_us, heur)
                gap = heur / best - 1
                row = {
                    "placement": shape,
                    "p": p,
                    "m": m,
                    "heuristic_us": heur,
                    "heuristic": heur_name,
                    "exact_us": exact.estimate.step_time_us,
                    "lower_bound_us": exact.lower_bound_us,
                    "proven_optimal": exact.optimal,
                    "gap_to_exact": gap,
                    "gap_to_bound": heur / exact.lower_bound_us - 1 if exact.lower_bound_us > 0 else None,
                    "heuristic_seconds": heur_s,
                    "exact_seconds": exact.seconds,
                }
                rows.append(row)
                print(
                    f"{shape:9} {p:2d} {m:2d} {heur:10.1f} {exact.estimate.step_time_us:9.1f} {exact.lower_bound_us:9.1f} "
                    f"{gap:7.2%} {'yes' if exact.optimal else 'no':>6} {heur_s:7.2f} {exact.seconds:8.2f}  {heur_name}",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"script": "bench/tune_exact.py", "time_limit_s": args.time_limit, "rows": rows}, indent=2) + "\n"
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
