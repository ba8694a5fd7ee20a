"""``octopipe run``: run a Plan on local CPU ranks (or join a torchrun launch) and report what was measured."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from octopipe.execute.cli.compiling import add_compile_argument, compile_line
from octopipe.execute.cli.jsonout import estimate_json, print_json
from octopipe.execute.cli.profile import load_profile, save_profile
from octopipe.execute.cli.progress import spinner
from octopipe.execute.cli.torchrun import torchrun_rank
from octopipe.execute.devices import RUN_DEVICES, is_gpu
from octopipe.execute.runs import RunOptions
from octopipe.ir import load_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate
from octopipe.tune import ScheduleRegistry

__all__ = ["register", "run"]


def _cpu_list(text: str) -> tuple[int, ...]:
    """``0,1`` or ``0-3,6`` -> the cores (argparse type: a ValueError becomes a usage error)."""
    cores: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"--cpus takes core numbers such as 0,1 or 0-3, got {text!r}")
        cores.extend(range(int(low), int(high or low) + 1))
    return tuple(cores)


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe run`` to the CLI's subcommands."""
    parser = sub.add_parser(
        "run", help="run a plan on local ranks (CPU and gloo, or --device cuda) or join a torchrun launch"
    )
    parser.set_defaults(handler=run)
    parser.add_argument("plan", type=Path, help="plan file (.binpb, .json, .txt, .csv) naming its model")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="the model's seed on every rank")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any rank may wait for a message")
    parser.add_argument("--profile", type=Path, help="a Profile: also simulate the plan and compare")
    parser.add_argument(
        "--emulate",
        type=Path,
        metavar="PROFILE",
        help="compute nothing: run every rank's real program (interpreter, channels, gloo messages of the "
        "profiled sizes) with each computation waiting for its duration in PROFILE, and compare with the "
        "simulation of the same profile; no model is built, so 4-16-rank plans run on a small machine "
        "(a dry run of a cluster plan)",
    )
    parser.add_argument("--trace", type=Path, help="write a Perfetto trace (simulated and measured side by side)")
    parser.add_argument("--timeline", type=Path, help="write the measured timelines as a Profile (.binpb/.json)")
    parser.add_argument(
        "--device",
        choices=RUN_DEVICES,
        default="cpu",
        help="where ranks compute: cpu (gloo) or cuda (NCCL; local rank r on GPU r, torchrun's LOCAL_RANK)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin each rank to its own core")
    parser.add_argument(
        "--cpus", type=_cpu_list, default=(), help="cores to pin ranks to, e.g. 0,1 or 0-3 (default: every online CPU)"
    )
    parser.add_argument("--strict-pinning", action="store_true", help="refuse to run ranks that would share a core")
    parser.add_argument(
        "--skip-numerics-check",
        action="store_true",
        help="whole-model capture: do not check before the first step that the pipelined forward reproduces "
        "the model's own loss on one micro-batch (checked by default; a mismatch refuses to train, naming the stage)",
    )
    add_compile_argument(parser)
    parser.add_argument("--json", action="store_true", help="print losses and step times as JSON instead of a table")
    parser.add_argument(
        "--torchrun", action="store_true", help="join an external launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/run"), help="--torchrun: where each rank writes results")


def _join_torchrun(plan: plan_pb2.Plan, args: argparse.Namespace) -> int:
    options = RunOptions(
        steps=args.steps,
        seed=args.seed,
        timeout_s=args.timeout,
        pin_cores=not args.no_pin,
        numerics_check=not args.skip_numerics_check,
        device=args.device,
        compile=args.compile,
    )
    rank, _ = torchrun_rank(plan, options, args.out)
    sys.stdout.write(f"rank {rank}: results in {args.out / f'rank{rank}.pt'}\n")
    return 0


EMULATED_LINE = (
    "compute EMULATED from {profile}: every computation waited for its profiled duration; these step times are "
    "the runtime's, its messages' and the link's, not kernels'"
)


def _emulate(plan: plan_pb2.Plan, args: argparse.Namespace) -> int:
    """``octopipe run PLAN --emulate PROFILE``: the real runtime with emulated computations, beside the simulation."""
    from octopipe.execute.runtime import (  # noqa: PLC0415
        measured_step_times_us,
        run_local,
        timelines_to_proto,
        write_side_by_side_trace,
    )

    if args.torchrun or is_gpu(args.device) or args.profile:
        raise ValueError(
            "--emulate runs local CPU ranks and simulates its own profile: drop --torchrun, --device and --profile"
        )
    profile = load_profile(args.emulate)
    simulation = simulate(plan, local_cost_model(plan, profile))
    options = RunOptions(steps=args.steps, timeout_s=args.timeout, pin_cores=False, emulate=profile)
    with spinner(f"emulating {args.steps} steps on {len(plan.ranks)} local ranks ...", enabled=not args.json):
        result = run_local(plan, options)
    times = measured_step_times_us(result)
    line = EMULATED_LINE.format(profile=args.emulate)
    if args.timeline:
        message = profile_pb2.Profile(device="emulated")
        message.model.CopyFrom(plan.model)
        message.labels["compute"] = "emulated"
        message.labels["emulated_from"] = str(args.emulate)
        message.timelines.extend(timelines_to_proto(result))
        save_profile(message, args.timeline)
    if args.trace:
        write_side_by_side_trace(args.trace, simulation, result, step=len(times) - 1)
    if args.json:
        print_json(
            {
                "plan": plan.name,
                "compute": "emulated",
                "emulated_from": str(args.emulate),
                "emulated_step_ms": [t / 1e3 for t in times],
                "simulated": estimate_json(simulation.estimate),
                "files": {k: str(v) for k, v in (("timeline", args.timeline), ("trace", args.trace)) if v},
            }
        )
        return 0
    console = Console()
    table = Table(
        title=f"{plan.name or args.plan.name}: {len(plan.ranks)} ranks, {plan.num_microbatches} "
        "micro-batches, compute EMULATED"
    )
    for column in ("step", "emulated step ms", "simulated step ms", "emulated / simulated"):
        table.add_column(column, justify="right")
    predicted = simulation.estimate.step_time_us
    for step, time_us in enumerate(times):
        table.add_row(str(step), f"{time_us / 1e3:.1f}", f"{predicted / 1e3:.1f}", f"{time_us / predicted:.3f}")
    console.print(table)
    console.print(line, soft_wrap=True)
    if args.timeline:
        console.print(f"timelines: {args.timeline} (labelled compute: emulated)")
    if args.trace:
        console.print(f"trace: {args.trace} (simulated and emulated ranks; open in https://ui.perfetto.dev)")
    return 0


def run(args: argparse.Namespace) -> int:

    from octopipe.execute.runtime import (  # noqa: PLC0415
        measured_step_times_us,
        run_local,
        timelines_to_proto,
        write_side_by_side_trace,
    )

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    plan = load_plan(args.plan)
    if args.emulate:
        return _emulate(plan, args)
    if not plan.HasField("model") or not plan.model.source:
        raise ValueError(f"{args.plan}: the plan names no model (set model.source, e.g. octopipe.examples:workload)")
    if args.torchrun:
        return _join_torchrun(plan, args)
    simulation = simulate(plan, local_cost_model(plan, load_profile(args.profile))) if args.profile else None

    with spinner(
        f"running {args.steps} steps on {len(plan.ranks)} local ranks ({args.device}) ...", enabled=not args.json
    ):
        result = run_local(
            plan,
            RunOptions(
                steps=args.steps,
                seed=args.seed,
                timeout_s=args.timeout,
                pin_cores=not args.no_pin,
                cpus=args.cpus,
                strict_pinning=args.strict_pinning,
                numerics_check=not args.skip_numerics_check,
                device=args.device,
                compile=args.compile,
            ),
        )
    times = measured_step_times_us(result)
    if args.timeline:
        message = profile_pb2.Profile(device=args.device)
        message.model.CopyFrom(plan.model)
        message.timelines.extend(timelines_to_proto(result))
        save_profile(message, args.timeline)
    if args.trace:
        write_side_by_side_trace(args.trace, simulation, result, step=len(times) - 1)
    if args.json:
        print_json(
            {
                "plan": plan.name,
                "losses": result.losses,
                "measured_step_ms": [t / 1e3 for t in times],
                "rank_cores": {str(rank): cores for rank, cores in sorted(result.cores.items())},
                "numerics_check": {str(rank): figures for rank, figures in sorted(result.numerics.items())} or None,
                "compile": args.compile,
                "stage_backends": {str(stage): note for stage, note in sorted(result.stage_backends.items())},
                "simulated": estimate_json(simulation.estimate) if simulation is not None else None,
                "files": {k: str(v) for k, v in (("timeline", args.timeline), ("trace", args.trace)) if v},
            }
        )
        return 0
    console = Console()
    table = Table(
        title=f"{plan.name or args.plan.name}: {len(plan.ranks)} ranks, {plan.num_microbatches} micro-batches"
    )
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("measured step ms", justify="right")
    if simulation is not None:
        table.add_column("simulated step ms", justify="right")
    for step, (loss, time_us) in enumerate(zip(result.losses, times, strict=True)):
        row = [str(step), f"{loss:.5f}", f"{time_us / 1e3:.1f}"]
        if simulation is not None:
            row.append(f"{simulation.estimate.step_time_us / 1e3:.1f}")
        table.add_row(*row)
    console.print(table)
    console.print("cores: " + ", ".join(f"rank {r} on {c}" for r, c in sorted(result.cores.items())))
    console.print(compile_line(args.compile, result.stage_backends), soft_wrap=True)
    if result.numerics:  # whole-model capture: the guard passed on every rank before the first step
        worst = max(figures["seconds"] for figures in result.numerics.values())
        loss = next(iter(result.numerics.values()))["reference_loss"]
        console.print(f"numerics guard passed: loss {loss:.5f}, as the model computes it ({worst:.2f} s)")
    if args.timeline:
        console.print(f"timelines: {args.timeline}")
    if args.trace:
        console.print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    return 0
