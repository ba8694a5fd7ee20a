"""``octopipe train [CONFIG.toml]``: a training job from one readable file (or the embedded default)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from octopipe.execute.cli.progress import spinner
from octopipe.execute.train_config import keys_help, load_train_config
from octopipe.tune import ScheduleRegistry

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
    parser.add_argument("--out", type=Path, default=Path("out/train"), help="where metrics.jsonl goes")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from octopipe.execute.runs import RunOptions  # noqa: PLC0415 - torch loads only for commands that need it
    from octopipe.execute.runtime import measured_step_times_us, run_local, workload_reference  # noqa: PLC0415
    from octopipe.execute.runtime.pipeline import baseline_plan  # noqa: PLC0415
    from octopipe.ir import load_plan  # noqa: PLC0415

    config = load_train_config(args.config)
    steps = args.steps if args.steps is not None else config.steps
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    model, plan_keys, run_keys = config.section("model"), config.section("plan"), config.section("run")
    reference = workload_reference(
        model["workload"],
        tiny=model["tiny"],
        vocab=model["vocab"],
        sequence=model["sequence"],
        global_batch=model["global_batch"],
    )
    if plan_keys["file"]:
        plan = load_plan(Path(plan_keys["file"]))
        if plan.model.SerializeToString(deterministic=True) != reference.SerializeToString(deterministic=True):
            raise ValueError(f"[plan] file {plan_keys['file']} names another model than [model]: make them agree")
    else:
        plan = baseline_plan(
            reference,
            num_ranks=plan_keys["ranks"],
            num_microbatches=plan_keys["microbatches"],
            schedule=plan_keys["schedule"],
        )
    options = RunOptions(
        steps=steps,
        seed=run_keys["seed"],
        timeout_s=max(run_keys["timeout_s"], 1.0),
        optimization=config.optimization(steps),
        data=config.data(),
        checkpoint_dir=run_keys["checkpoint_dir"],
        checkpoint_every=run_keys["checkpoint_every"],
    )
    with spinner(f"training {plan.name} for {steps} steps ({config.source}) ...", enabled=not args.json):
        result = run_local(plan, options)
    rates = [options.optimization.lr_at(s) for s in range(steps)]
    step_us = measured_step_times_us(result)  # first rank's start to last rank's end, each step
    tokens = model["global_batch"] * model["sequence"]
    args.out.mkdir(parents=True, exist_ok=True)
    metrics = args.out / "metrics.jsonl"
    with metrics.open("w") as out:
        for step, loss in enumerate(result.losses):
            row: dict[str, Any] = {"step": step, "loss": loss, "learning_rate": rates[step]}
            row["step_ms"] = step_us[step] / 1e3
            row["tokens_per_s"] = tokens / (step_us[step] / 1e6)
            if result.grad_norms:
                row["grad_norm"] = result.grad_norms[step]
            out.write(json.dumps(row) + "\n")
    summary = {
        "config": config.source,
        "plan": plan.name,
        "steps": steps,
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "metrics": str(metrics),
        "wall_s": round(result.wall_s, 2),
    }
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return 0
    every = max(1, steps // 10)
    sys.stdout.write(f"{'step':>6} {'loss':>9} {'lr':>10}\n")
    for step in sorted({*range(0, steps, every), steps - 1}):
        sys.stdout.write(f"{step:>6} {result.losses[step]:>9.4f} {rates[step]:>10.2e}\n")
    sys.stdout.write(
        f"trained {plan.name} for {steps} steps in {result.wall_s:.1f} s: loss {summary['first_loss']:.4f} -> "
        f"{summary['last_loss']:.4f}; metrics: {metrics}\n"
    )
    return 0
