"""``octopipe tune``: search partition x placement x schedule for a Profile; write the plan and predicted metrics."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate
from octopipe.simulate.ir import plan_to_text, save_plan
from octopipe.tune import FAMILIES, TuneConfig, TuneResult, tune

__all__ = ["add_parser", "load_profile", "run"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("tune", help="tune partition, placement and schedule for a Profile; write the plan")
    parser.add_argument("profile", type=Path, help="a Profile (.binpb/.pb or .json), e.g. from `octopipe profile`")
    parser.add_argument("--ranks", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument(
        "--memory-cap", type=int, help="bytes per rank (default: the peak of 1F1B on equal layer counts)"
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"placements to search ({', '.join(FAMILIES)})")
    parser.add_argument("--time-budget", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--max-evaluations", type=int, default=3000, help="simulations at most (default 3000)")
    parser.add_argument("--kicks", type=int, default=1, help="random restarts of the partition search per placement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/tuned.binpb"), help="plan file (.binpb/.pb or .json)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def load_profile(path: Path) -> profile_pb2.Profile:
    """Read a Profile from binary proto (.binpb/.pb) or proto JSON (.json); ValueError naming the file otherwise."""
    if path.suffix not in (".binpb", ".pb", ".json"):
        raise ValueError(f"{path}: give a profile as .binpb, .pb or .json")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    profile = profile_pb2.Profile()
    try:
        if path.suffix == ".json":
            json_format.Parse(data.decode(), profile)
        else:
            profile.ParseFromString(data)
    except (json_format.ParseError, DecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not an octopipe.profile.v1.Profile: {exc}") from None
    return profile


def run(args: argparse.Namespace) -> int:
    if args.out.suffix not in (".binpb", ".pb", ".json"):
        raise ValueError(f"--out {args.out}: write the plan as .binpb, .pb or .json (a .txt is written beside it)")
    profile = load_profile(args.profile)
    config = TuneConfig(
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        memory_cap_bytes=args.memory_cap,
        families=tuple(f.strip() for f in args.families.split(",") if f.strip()),
        time_budget_s=args.time_budget,
        max_evaluations=args.max_evaluations,
        kicks=args.kicks,
        seed=args.seed,
    )
    result = tune(profile, config) if args.json else _tune_with_progress(profile, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_plan(result.plan, args.out)
    text_path = args.out.with_suffix(".txt")
    text_path.write_text(plan_to_text(result.plan))
    if args.json:
        sys.stdout.write(json.dumps(_as_json(result, args.out, text_path), indent=2) + "\n")
    else:
        _print_tables(result, args.out, text_path)
    return 0


def _tune_with_progress(profile: profile_pb2.Profile, config: TuneConfig) -> TuneResult:
    from rich.console import Console  # noqa: PLC0415 - only the interactive path draws

    console = Console(stderr=True)
    with console.status("tuning ...") as status:

        def progress(message: str, evaluations: int, best_us: float) -> None:
            status.update(f"tuning: {message} | {evaluations} simulations | best step {best_us / 1e3:.1f} ms")

        return tune(profile, config, progress=progress)


def _estimate_json(estimate: Estimate) -> dict[str, Any]:
    return {
        "step_time_us": estimate.step_time_us,
        "samples_per_second": estimate.samples_per_second,
        "bubble_ratio": estimate.bubble_ratio,
        "communication_overlap_ratio": estimate.communication_overlap_ratio,
        "peak_memory_bytes": [r.peak_memory_bytes for r in estimate.ranks],
        "fits": estimate.fits,
    }


def _as_json(result: TuneResult, plan_path: Path, text_path: Path) -> dict[str, Any]:
    return {
        "plan": str(plan_path),
        "plan_text": str(text_path),
        "description": result.description,
        "speedup_over_1f1b_equal": result.speedup,
        "tuned": _estimate_json(result.estimate),
        "baseline_1f1b_equal": _estimate_json(result.baseline),
        "memory_cap_bytes": [result.memory_caps[r] for r in sorted(result.memory_caps)],
        "best_by_family_us": dict(result.best_by_family),
        "evaluations": result.evaluations,
        "seconds": result.seconds,
        "stopped": result.stopped,
        "phases": [
            {
                "family": p.family,
                "phase": p.phase,
                "before_us": p.before_us,
                "after_us": p.after_us,
                "gain": p.gain,
                "detail": p.detail,
            }
            for p in result.phases
        ],
    }


def _print_tables(result: TuneResult, plan_path: Path, text_path: Path) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console()
    table = Table(title=f"predicted step ({result.description})")
    for column in ("plan", "step ms", "samples/s", "bubble", "peak memory MiB (max rank)", "within caps"):
        table.add_column(column, justify="right" if column != "plan" else "left")
    for name, estimate in (("1F1B, equal layer counts", result.baseline), ("tuned", result.estimate)):
        table.add_row(
            name,
            f"{estimate.step_time_us / 1e3:.2f}",
            f"{estimate.samples_per_second:.2f}",
            f"{estimate.bubble_ratio:.1%}",
            f"{max(r.peak_memory_bytes for r in estimate.ranks) / 2**20:.1f}",
            "yes" if estimate.fits else "no",
        )
    console.print(table)
    search = Table(title="search: what each phase gained")
    for column in ("placement", "phase", "before ms", "after ms", "gain", "schedule"):
        search.add_column(column)
    for phase in result.phases:
        if phase.after_us < phase.before_us or phase.phase == "schedule":
            search.add_row(
                phase.family,
                phase.phase,
                f"{phase.before_us / 1e3:.2f}",
                f"{phase.after_us / 1e3:.2f}",
                f"{phase.gain:.3f}x",
                phase.detail,
            )
    console.print(search)
    console.print(
        f"speedup over 1F1B with equal layer counts: {result.speedup:.3f}x; {result.evaluations} simulations in "
        f"{result.seconds:.1f} s ({result.stopped}); memory cap {max(result.memory_caps.values()) / 2**20:.1f} MiB "
        f"per rank\nwritten: {plan_path} and {text_path}"
    )
