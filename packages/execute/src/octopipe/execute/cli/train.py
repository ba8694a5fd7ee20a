"""``octopipe train [CONFIG.toml]``: a training job from one readable file (or the embedded default)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from octopipe.execute.cli.compiling import compile_line
from octopipe.execute.cli.profile import load_profile
from octopipe.execute.cli.progress import step_bar
from octopipe.execute.cli.torchrun import torchrun_rank
from octopipe.execute.runs import STAGE_BACKENDS, StepTimeline
from octopipe.execute.train_config import TrainConfig, keys_help, load_train_config
from octopipe.tune import ScheduleRegistry

if TYPE_CHECKING:
    from octopipe.execute.runtime.job import TrainSummary

__all__ = ["register", "run"]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe train`` to the CLI's subcommands."""
    del registry
    parser = sub.add_parser(
        "train",
        help="train a model from a TOML config on local CPU ranks (no config: the embedded default job)",
        description="Train a model on local CPU ranks as a TOML file says; with no file, the embedded default: "
        "a small heterogeneous zoo model (Mamba, attention, MoE) on the Python standard library's source.",
        epilog=keys_help(),
    )
    parser.set_defaults(handler=run)
    parser.add_argument("config", type=Path, nargs="?", help="the TOML file (default: the embedded default job)")
    parser.add_argument("--steps", type=int, help="override [run] steps")
    parser.add_argument("--out", type=Path, default=Path("out/train"), help="where metrics.jsonl and tensorboard/ go")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--compile", choices=STAGE_BACKENDS, help="override [run] compile (auto, inductor, eager)")
    parser.add_argument(
        "--torchrun",
        action="store_true",
        help="join a torchrun launch as one rank (torchrun --nproc-per-node N -m octopipe.execute train CONFIG "
        "--torchrun); ranks' results go to OUT/ranks, and rank 0 writes the metrics once every rank's are there",
    )


def _torchrun(args: argparse.Namespace, config: TrainConfig, steps: int, profile: Any) -> TrainSummary | None:
    """This process's rank of the job in a torchrun launch; on rank 0, then the whole run's summary."""
    from octopipe.execute.runtime.job import gather_rank_results, prepare_job, summarize  # noqa: PLC0415

    if config.section("plan")["schedule"] == "tune":
        raise ValueError(
            "[plan] schedule = 'tune' under --torchrun: every rank would search on its own; tune first "
            "(octopipe profile, octopipe tune) and give the plan as [plan] file"
        )
    started = time.monotonic()
    job = prepare_job(config, steps)
    options = dataclasses.replace(job.options, pin_cores=False)  # the launcher placed the processes
    rank, world = torchrun_rank(job.plan, options, args.out / "ranks")
    if rank != 0:
        sys.stdout.write(f"rank {rank}: results in {args.out / 'ranks' / f'rank{rank}.pt'}\n")
        return None
    result = gather_rank_results(args.out / "ranks", job.plan, world, options.timeout_s)
    if result is None:
        raise ValueError(
            f"rank 0 finished, but not every rank's results reached {args.out / 'ranks'} within "
            f"{options.timeout_s:.0f} s (ranks on other machines write theirs there): metrics.jsonl not written"
        )
    return summarize(config, job, result, args.out, started=started, profile=profile)


def run(args: argparse.Namespace) -> int:
    from octopipe.execute.runtime.job import train  # noqa: PLC0415 - torch loads only for commands that need it

    config = load_train_config(args.config)
    if args.compile is not None:  # the flag over the file's [run] compile
        values = {**config.values, "run": {**config.values["run"], "compile": args.compile}}
        config = dataclasses.replace(config, values=values)
    steps = args.steps if args.steps is not None else config.steps
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    profile_file = config.section("metrics")["profile"]
    profile = load_profile(Path(profile_file)) if profile_file else None
    if args.torchrun:
        joined = _torchrun(args, config, steps, profile)
        if joined is None:
            return 0
        summary = joined
    else:
        with step_bar(f"training ({config.source})", steps, enabled=not args.json) as advance:

            def on_step(timeline: StepTimeline) -> None:
                if timeline.loss is not None:  # the last stage's rank: one report per step
                    advance(timeline.step, timeline.loss)

            summary = train(config, steps=steps, out=args.out, on_step=on_step, profile=profile)
    result, rows = summary.result, summary.rows
    report = {
        "config": config.source,
        "plan": summary.extra["plan"],
        "steps": steps,
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "metrics": str(summary.metrics),
        "tensorboard": str(summary.tensorboard) if summary.tensorboard else None,
        "first_step_s": round(summary.first_step_s, 3),
        "first_step_end_monotonic_s": summary.extra["first_step_end_monotonic_s"],
        "rank_cores": {str(rank): cores for rank, cores in sorted(result.cores.items())},
        "wall_s": round(result.wall_s, 2),
        "median_step_ms": round(statistics.median(r["step_ms"] for r in rows), 3),
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
        "median_mfu": round(statistics.median(r["mfu"] for r in rows), 4) if "mfu" in rows[0] else None,
        "median_bubble": round(statistics.median(r["bubble"] for r in rows), 4),
        "predicted_step_ms": rows[0].get("predicted_step_ms"),
        "predicted_bubble": rows[0].get("predicted_bubble"),
        "compile": config.values["run"]["compile"],
        "stage_backends": {str(stage): note for stage, note in sorted(result.stage_backends.items())},
    }
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    sys.stdout.write(compile_line(report["compile"], result.stage_backends) + "\n")
    every = max(1, steps // 10)
    sys.stdout.write(f"{'step':>6} {'loss':>9} {'lr':>10} {'step ms':>9} {'tokens/s':>10} {'mfu':>7}\n")
    for step in sorted({*range(0, steps, every), steps - 1}):
        row = rows[step]
        mfu = f"{row['mfu']:.2%}" if "mfu" in row else "-"
        sys.stdout.write(
            f"{step:>6} {row['loss']:>9.4f} {row['learning_rate']:>10.2e} {row['step_ms']:>9.1f} "
            f"{row['tokens_per_s']:>10.0f} {mfu:>7}\n"
        )
    if report["predicted_step_ms"] is not None:
        sys.stdout.write(
            f"median step {report['median_step_ms']:.1f} ms, bubble {report['median_bubble']:.1%}; the simulator "
            f"predicted {report['predicted_step_ms']:.1f} ms, bubble {report['predicted_bubble']:.1%}\n"
        )
    sys.stdout.write(
        f"trained {report['plan']} for {steps} steps in {result.wall_s:.1f} s (first step done "
        f"{summary.first_step_s:.1f} s after the start): loss {report['first_loss']:.4f} -> "
        f"{report['last_loss']:.4f}; metrics: {summary.metrics}"
        f"{f', TensorBoard: {summary.tensorboard}' if summary.tensorboard else ''}\n"
    )
    return 0
