"""``octopipe tune``: search partition x placement x schedule for a Profile; write the plan and predicted metrics.

Two modes. ``--ranks R --microbatches M``: the co-optimizer for one pipeline
(``octopipe.tune.tune``). ``--devices D --global-batch G --memory-cap 80GB``:
choose the mesh too, pp x dp (and the micro-batch count), with FSDP
collectives (``octopipe.tune.tune_mesh``), timed from the Profile's
collective costs or ``--collective-bandwidth`` / ``--collective-latency-us``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from octopipe.execute.cli.jsonout import estimate_json
from octopipe.execute.cli.profile import load_profile
from octopipe.execute.devices import device_memory_budget
from octopipe.ir import plan_to_text, save_plan
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate, GroupLinks, Link, local_link
from octopipe.tune import (
    FAMILIES,
    MeshTuneConfig,
    MeshTuneResult,
    ScheduleRegistry,
    TuneConfig,
    TuneResult,
    tune,
    tune_mesh,
)

__all__ = ["parse_bytes", "register", "run"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """Bytes from ``1073741824``, ``80GB`` (10^9), ``80GiB`` (2^30), ``50GB/s`` (a rate, per second)."""
    match = _SIZE.fullmatch(text.removesuffix("/s"))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe tune`` to the CLI's subcommands."""
    parser = sub.add_parser("tune", help="tune partition, placement and schedule for a Profile; write the plan")
    parser.set_defaults(handler=run)
    parser.add_argument("profile", type=Path, help="a Profile (.binpb/.pb or .json), e.g. from `octopipe profile`")
    parser.add_argument("--ranks", type=int, help="pipeline ranks (one pipeline; or give --devices)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step (with --ranks)")
    parser.add_argument(
        "--memory-budget",
        "--memory-cap",
        dest="memory_cap",
        type=_budget,
        help="bytes per rank or device: a size (80GB, 80GiB), `device` (the profile's device: a GPU's memory, or "
        "the host's shared by the ranks, less --memory-reserve) or `1f1b` (the peak of 1F1B on equal layer "
        "counts); default with --ranks: device",
    )
    parser.add_argument(
        "--memory-reserve",
        type=float,
        default=0.1,
        help="with --memory-budget device: the fraction kept back (default 0.1)",
    )
    parser.add_argument(
        "--recompute",
        nargs="+",
        metavar="POLICY",
        help="recomputation policies to search per stage (none, layers, budget:F; each profiled, see "
        "`octopipe profile --recompute`); default: every policy the profile has; `none` alone: none",
    )
    mesh = parser.add_argument_group("mesh mode (choose pp x dp x micro-batches for a number of devices)")
    mesh.add_argument("--devices", type=int, help="accelerators in all (pp x dp)")
    mesh.add_argument("--global-batch", type=int, help="samples per optimizer step over all replicas")
    mesh.add_argument(
        "--collective-bandwidth",
        type=parse_bytes,
        help="data-parallel ring bandwidth per rank, e.g. 50GB/s (replaces the profile's collectives; default: them)",
    )
    mesh.add_argument("--collective-latency-us", type=float, default=5.0, help="per ring hop (default 5)")
    mesh.add_argument("--p2p-bandwidth", type=parse_bytes, help="pipeline sends, e.g. 50GB/s (default: profile links)")
    mesh.add_argument("--p2p-latency-us", type=float, default=5.0, help="pipeline sends (default 5)")
    mesh.add_argument("--pipeline-degrees", help="pp values to try, e.g. 4,8,16 (default: every divisor)")
    mesh.add_argument("--max-microbatches", type=int, default=64, help="per replica (default 64)")
    mesh.add_argument(
        "--ep",
        type=int,
        help="expert-parallel degree (default: every one that divides dp and the MoE layers' experts is tried)",
    )
    mesh.add_argument(
        "--tp",
        help="tensor-parallel degrees to try inside stages, e.g. 1,2,4,8 (default: 1, none; each must divide the "
        "model's heads and hidden units to run)",
    )
    mesh.add_argument("--cp", help="context-parallel degrees to try, e.g. 1,2,4 (default: 1, none; not with Mamba)")
    mesh.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="meshes with tp > 1 run Megatron sequence parallelism (default: off)",
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"placements to search ({', '.join(FAMILIES)})")
    parser.add_argument("--time-budget", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--max-evaluations", type=int, default=3000, help="simulations at most (default 3000)")
    parser.add_argument("--kicks", type=int, default=1, help="random restarts of the partition search per placement")
    parser.add_argument("--seed", type=int, default=0, help="the search's random seed (same seed, same plan)")
    parser.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="the simulator's step-time error, e.g. 0.05: a more complex plan must beat a simpler one "
        "(1F1B on equal layers first) by more than this to be chosen (default 0: the fastest)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/tuned.binpb"), help="plan file (.binpb/.pb or .json)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    if args.out.suffix not in (".binpb", ".pb", ".json"):
        raise ValueError(f"--out {args.out}: write the plan as .binpb, .pb or .json (a .txt is written beside it)")
    if args.devices is not None:
        return _run_mesh(args)
    if args.ranks is None or args.microbatches is None:
        raise ValueError(
            "give --ranks and --microbatches (one pipeline), or --devices, --global-batch and --memory-cap"
        )
    profile = load_profile(args.profile)
    requested = "device" if args.memory_cap is None else args.memory_cap
    budget, args.memory_budget_source = _resolve_budget(requested, profile, args)
    config = TuneConfig(
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        memory_cap_bytes=budget,
        recompute=tuple(args.recompute) if args.recompute else None,
        families=tuple(f.strip() for f in args.families.split(",") if f.strip()),
        time_budget_s=args.time_budget,
        max_evaluations=args.max_evaluations,
        kicks=args.kicks,
        seed=args.seed,
        min_gain=args.min_gain,
        default_link=local_link(profile),  # the link `octopipe simulate` and `octopipe run` check it with
        registry=args.registry,
    )
    result = tune(profile, config) if args.json else _tune_with_progress(profile, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_plan(result.plan, args.out)
    text_path = args.out.with_suffix(".txt")
    text_path.write_text(plan_to_text(result.plan))
    if args.json:
        report = _as_json(result, args.out, text_path) | {"memory_budget": args.memory_budget_source}
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        _print_tables(result, args.out, text_path)
        Console().print(f"memory budget: {args.memory_budget_source}")
    return 0


def _run_mesh(args: argparse.Namespace) -> int:
    if args.ranks is not None or args.microbatches is not None:
        raise ValueError("--devices chooses the pipeline ranks and micro-batches: drop --ranks and --microbatches")
    if args.global_batch is None or args.memory_cap is None:
        raise ValueError("--devices needs --global-batch (samples per step) and --memory-cap (per device, e.g. 80GB)")
    if not isinstance(args.memory_cap, int):
        raise ValueError("--devices needs --memory-cap as a size per device, e.g. 80GB")
    if args.recompute:
        raise ValueError("--recompute is searched for one pipeline (--ranks); the mesh search runs none")
    tp_degrees, cp_degrees = _degrees("--tp", args.tp), _degrees("--cp", args.cp)  # checked before any work
    profile = load_profile(args.profile)
    links = None
    if args.collective_bandwidth is not None:
        links = GroupLinks(
            data_parallel=Link(
                latency_us=args.collective_latency_us, bandwidth_bytes_per_second=args.collective_bandwidth
            )
        )
    p2p = None
    if args.p2p_bandwidth is not None:
        p2p = Link(latency_us=args.p2p_latency_us, bandwidth_bytes_per_second=args.p2p_bandwidth)
    elif not profile.links:
        raise ValueError("the profile has no links between ranks: give --p2p-bandwidth (e.g. 50GB/s)")
    degrees = _degrees("--pipeline-degrees", args.pipeline_degrees)
    config = MeshTuneConfig(
        devices=args.devices,
        global_batch=args.global_batch,
        memory_cap_bytes=args.memory_cap,
        collectives=links,
        p2p_link=p2p,
        pipeline_degrees=degrees,
        families=tuple(f.strip() for f in args.families.split(",") if f.strip()),
        max_microbatches=args.max_microbatches,
        ep=args.ep,
        registry=args.registry,
        tp_degrees=tp_degrees,
        cp_degrees=cp_degrees,
        sequence_parallel=args.sequence_parallel,
    )
    result = tune_mesh(profile, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_plan(result.plan, args.out)
    text_path = args.out.with_suffix(".txt")
    text_path.write_text(plan_to_text(result.plan))
    if args.json:
        sys.stdout.write(json.dumps(_mesh_json(result, args.out, text_path), indent=2) + "\n")
    else:
        _print_mesh(result, args.out, text_path)
    return 0


def _budget(text: str) -> int | str:
    """``--memory-budget``: a size in bytes, or ``device`` / ``1f1b`` (resolved once the profile is read)."""
    return text if text in ("device", "1f1b") else parse_bytes(text)


def _resolve_budget(
    budget: int | str, profile: profile_pb2.Profile, args: argparse.Namespace
) -> tuple[int | None, str]:
    """The cap per rank the tuner plans under (None: 1F1B's peak) and where it came from."""
    if isinstance(budget, int):
        return budget, f"{budget} bytes per rank (--memory-budget)"
    if budget == "1f1b":
        return None, "the peak of 1F1B on equal layer counts (--memory-budget 1f1b)"
    device = "cuda" if profile.device.lower().startswith("cuda") else "cpu"  # the profiler writes cpu or cuda
    cap, where = device_memory_budget(device, args.ranks, args.memory_reserve)
    return cap, f"{cap} bytes per rank: {where} (--memory-budget device)"


def _degrees(flag: str, text: str | None) -> tuple[int, ...] | None:
    """A comma-separated list of positive degrees (None when the flag was not given)."""
    if not text:
        return None
    try:
        values = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give positive integers, e.g. 1,2,4") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: give positive integers, e.g. 1,2,4")
    return values


def _mesh_json(result: MeshTuneResult, plan_path: Path, text_path: Path) -> dict[str, Any]:
    return {
        "plan": str(plan_path),
        "plan_text": str(text_path),
        "pp": result.pp,
        "dp": result.dp,
        "tp": result.tp,
        "cp": result.cp,
        "sequence_parallel": result.plan.mesh.sequence_parallel,
        "ep": result.ep,
        "microbatches": result.num_microbatches,
        "microbatch_size": result.microbatch_size,
        "description": result.description,
        "tuned": estimate_json(result.estimate),
        "baseline_1f1b_same_mesh": estimate_json(result.baseline),
        "speedup_over_1f1b_same_mesh": result.speedup,
        "simulations": result.simulations,
        "seconds": result.seconds,
        "candidates": [
            {
                "pp": c.pp,
                "dp": c.dp,
                "tp": c.tp,
                "cp": c.cp,
                "ep": c.ep,
                "microbatches": c.num_microbatches,
                "microbatch_size": c.microbatch_size,
                "step_time_us": c.step_time_us,
                "fits": c.fits,
                "schedule": c.schedule,
                "peak_memory_bytes": c.peak_memory_bytes,
                "reason": c.reason,
            }
            for c in result.candidates
        ],
    }


def _print_mesh(result: MeshTuneResult, plan_path: Path, text_path: Path) -> None:

    console = Console()
    title = (
        f"chosen: pp {result.pp} x dp {result.dp} x cp {result.cp} x tp {result.tp}"
        f"{' (sequence parallel)' if result.plan.mesh.sequence_parallel else ''} (ep {result.ep}), "
        f"{result.num_microbatches} micro-batches of "
        f"{result.microbatch_size} per replica ({result.description})"
    )
    rows = (("1F1B, equal layer counts, same mesh", result.baseline), ("tuned", result.estimate))
    console.print(_estimate_table(title, rows, memory=("GB", 1e9), step_format=".1f"))
    tried = Table(title="every pp x dp x cp x tp x ep tried (its best plan)")
    for column in ("pp", "dp", "cp", "tp", "ep", "m", "step ms", "fits", "schedule / why not"):
        tried.add_column(column)
    for c in result.candidates:
        step = f"{c.step_time_us / 1e3:.1f}" if c.num_microbatches else "-"
        tried.add_row(
            str(c.pp),
            str(c.dp),
            str(c.cp),
            str(c.tp),
            str(c.ep),
            str(c.num_microbatches),
            step,
            "yes" if c.fits else "no",
            c.schedule or c.reason,
        )
    console.print(tried)
    console.print(
        f"speedup over 1F1B on the same mesh: {result.speedup:.3f}x; {result.simulations} simulations in "
        f"{result.seconds:.1f} s\nwritten: {plan_path} and {text_path}"
    )


def _tune_with_progress(profile: profile_pb2.Profile, config: TuneConfig) -> TuneResult:

    console = Console(stderr=True)
    with console.status("tuning ...") as status:

        def progress(message: str, evaluations: int, best_us: float) -> None:
            status.update(f"tuning: {message} | {evaluations} simulations | best step {best_us / 1e3:.1f} ms")

        return tune(profile, config, progress=progress)


def _estimate_table(
    title: str, rows: Sequence[tuple[str, Estimate]], *, memory: tuple[str, float], step_format: str
) -> Any:
    """Step time, throughput, bubble and peak memory of each (name, estimate), as a rich table."""

    unit, scale = memory
    table = Table(title=title)
    for column in ("plan", "step ms", "samples/s", "bubble", f"peak memory {unit} (max rank)", "within caps"):
        table.add_column(column, justify="right" if column != "plan" else "left")
    for name, estimate in rows:
        table.add_row(
            name,
            format(estimate.step_time_us / 1e3, step_format),
            f"{estimate.samples_per_second:.2f}",
            f"{estimate.bubble_ratio:.1%}",
            f"{max(r.peak_memory_bytes for r in estimate.ranks) / scale:.2f}",
            "yes" if estimate.fits else "no",
        )
    return table


def _as_json(result: TuneResult, plan_path: Path, text_path: Path) -> dict[str, Any]:
    return {
        "plan": str(plan_path),
        "plan_text": str(text_path),
        "description": result.description,
        "choice": result.choice,
        "speedup_over_1f1b_equal": result.speedup,
        "tuned": estimate_json(result.estimate),
        "baseline_1f1b_equal": estimate_json(result.baseline),
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

    console = Console()
    rows = (("1F1B, equal layer counts", result.baseline), ("tuned", result.estimate))
    title = f"predicted step ({result.description})"
    console.print(_estimate_table(title, rows, memory=("MiB", 2**20), step_format=".2f"))
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
        f"per rank\nchosen: {result.choice}\nwritten: {plan_path} and {text_path}"
    )
