"""The embedded default job: what ``./scripts/run.sh`` runs.

A heterogeneous zoo model (Nemotron-H-like by default) is profiled on this
machine (every layer's F, B and W graphs, and the gloo link between two local
ranks), tuned (partition x placement x schedule under 1F1B's memory peak),
checked by the static verifier, simulated, and run for a few steps on local
CPU ranks together with 1F1B on equal layer counts, alternating, in the same
launch. It prints the plan, predicted vs measured step time and memory and the
measured speed-up over 1F1B, and writes the plan (proto, text, torch CSV), the
profile, a Perfetto trace with the simulated and measured timelines side by
side, a PNG of the simulated timeline and a JSON summary.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from octopipe.execute.cli.compiling import add_compile_argument, compile_line
from octopipe.execute.cli.jsonout import dumps, estimate_json, print_json
from octopipe.execute.cli.profile import save_profile
from octopipe.execute.runs import STAGE_BACKENDS
from octopipe.ir import format_grid, mesh_spec, plan_to_text, plan_to_torch_csv, rank_actions, save_plan
from octopipe.simulate import local_cost_model, plot_timeline, verify_plan
from octopipe.tune import ScheduleRegistry, TuneConfig

if TYPE_CHECKING:  # the job's modules load torch: imported when the demo runs, not when the CLI starts
    from octopipe.execute.runtime import RunResult
    from octopipe.execute.runtime.pipeline import Comparison
    from octopipe.plan.v1 import plan_pb2
    from octopipe.profile.v1 import profile_pb2

__all__ = ["DemoConfig", "register", "run", "run_demo"]

#: model sizes: the zoo's unit-test sizes, a little larger, and shared/benchmarks.md's standard ones
SIZES: dict[str, dict[str, object]] = {
    "tiny": {"tiny": True, "sequence": 16},
    "small": {"tiny": True, "hidden": 64, "sequence": 32},
    "standard": {},
}


@dataclass(kw_only=True, frozen=True)
class DemoConfig:
    """What the demo runs: a zoo workload at a size, on ``ranks`` local ranks."""

    workload: str = "nemotronh-16"
    size: str = "tiny"
    ranks: int = 2
    microbatches: int = 8
    steps: int = 3
    rounds: int = 2
    tune_budget_s: float = 10.0
    #: the simulator's step-time error: a plan must beat 1F1B (and any simpler plan) by more to be chosen
    min_gain: float = 0.05
    profile_repeats: int = 3
    timeout_s: float = 300.0
    pin_cores: bool = True
    out: Path = Path("out/demo")
    #: how the stage graphs run (``RunOptions.compile``): auto, inductor or eager
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"--size {self.size!r}: choose one of {', '.join(SIZES)}")
        if self.ranks < 2 or self.microbatches < self.ranks:
            raise ValueError(f"use --ranks >= 2 and --microbatches >= --ranks (got {self.ranks}, {self.microbatches})")
        if self.compile not in STAGE_BACKENDS:
            raise ValueError(f"--compile {self.compile!r}: choose one of {', '.join(STAGE_BACKENDS)}")
        if self.steps < 2 or self.rounds < 1:
            raise ValueError(
                f"use --steps >= 2 (the first is warm-up) and --rounds >= 1 (got {self.steps}, {self.rounds})"
            )

    def reference(self) -> plan_pb2.ModelReference:
        from octopipe.execute.runtime import workload_reference  # noqa: PLC0415

        return workload_reference(self.workload, **SIZES[self.size])


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe demo`` to the CLI's subcommands."""
    parser = sub.add_parser(
        "demo", help="the embedded default job: profile, tune, verify, simulate and run a heterogeneous model"
    )
    parser.set_defaults(handler=run)
    parser.add_argument("--workload", default="nemotronh-16", help="jamba-8, nemotronh-16, llama-8 or moe-ep-4")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model sizes (default tiny: seconds)")
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="steps per plan and round; the first is warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="times the tuned plan and 1F1B alternate (default 2)")
    parser.add_argument("--tune-budget", type=float, default=10.0, help="seconds the tuner may search (default 10)")
    parser.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="the predicted gain a plan needs over a simpler one (default 0.05, the simulator's error)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin each rank to its own core")
    add_compile_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="where to write plans, trace, PNG")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no tables, no progress)")
    parser.add_argument("--verbose", action="store_true", help="also show the log events")


def run(args: argparse.Namespace) -> int:
    config = DemoConfig(
        workload=args.workload,
        size=args.size,
        ranks=args.ranks,
        microbatches=args.microbatches,
        steps=args.steps,
        rounds=args.rounds,
        tune_budget_s=args.tune_budget,
        min_gain=args.min_gain,
        pin_cores=not args.no_pin,
        out=args.out,
        compile=args.compile,
    )
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)  # the progress bars say what happens
    summary = run_demo(config, console=None if args.json else Console())
    if args.json:
        print_json(summary)
    return 0


def _run_plans(
    plans: Sequence[plan_pb2.Plan], steps: int, *, timeout_s: float, pin_cores: bool, compile: str
) -> list[RunResult]:
    """Run every plan for ``steps`` steps on local CPU ranks, one after the other; one result per plan.

    The plans go through an embedded control plane, the same code as a cluster: a coordinator (mutual
    TLS on 127.0.0.1) verifies each plan and pushes it to one node daemon with a slot per rank, which
    starts the rank processes and streams their measured timelines back.
    """
    from octopipe.execute.control import LocalCluster  # noqa: PLC0415 - keeps `octopipe --help` fast

    ranks = max(mesh_spec(plan).world_size for plan in plans)
    with tempfile.TemporaryDirectory(prefix="octopipe-demo-") as root, LocalCluster(Path(root)) as cluster:
        cluster.add_node("local", slots=ranks, pin_cores=pin_cores, rank_timeout_s=timeout_s)
        return cluster.run_plans(plans, steps=steps, timeout_s=timeout_s * (steps + 2), compile=compile)


@contextmanager
def _progress(console: Console | None) -> Iterator[Progress | None]:
    if console is None:
        yield None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield progress


class _Step:
    """One line of the progress display (nothing when there is no display)."""

    def __init__(self, progress: Progress | None, description: str, total: float | None = None) -> None:
        self.progress = progress
        self.task = progress.add_task(description, total=total) if progress is not None else None

    def update(self, description: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=description)

    def done(self, description: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=description, total=1, completed=1)


def run_demo(config: DemoConfig, *, console: Console | None = None) -> dict[str, Any]:
    """The whole job; prints tables on ``console`` (None: silent) and returns the JSON summary."""
    from octopipe.execute.runtime import pipeline  # noqa: PLC0415
    from octopipe.execute.runtime.linkprobe import local_links, measure_link  # noqa: PLC0415
    from octopipe.transform import StageCompiler, stage_backend  # noqa: PLC0415

    log = structlog.get_logger("octopipe.demo")
    reference = config.reference()
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    if console is not None:
        console.print(
            f"[bold]octopipe demo[/bold]: {config.workload} ({config.size} sizes) on {config.ranks} local CPU ranks, "
            f"{config.microbatches} micro-batches per step"
        )
    with _progress(console) as progress:
        names = pipeline.layer_names(reference)  # an unknown workload or size fails here, before any wait
        step = _Step(progress, f"profile F, I, W of {len(names)} layers (one thread)")
        profile = pipeline.profile_reference(  # the layers' graphs as the ranks will run them (compiled or not)
            reference,
            num_microbatches=config.microbatches,
            num_ranks=config.ranks,
            repeats=config.profile_repeats,
            compiler=StageCompiler(backend=stage_backend(config.compile)),
        )
        step.done(f"profiled {len(profile.layers)} layers")

        step = _Step(progress, "measure the gloo link between two local ranks")
        link, _ = measure_link(repeats=5)
        profile.links.extend(local_links(link, config.ranks))
        step.done(f"link: {link.latency_us:.0f} us + {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s")

        step = _Step(progress, "tune partition x placement x schedule")

        def tuning(message: str, evaluations: int, best_us: float) -> None:
            step.update(f"tune: {evaluations} simulations, best step {best_us / 1e3:.1f} ms ({message})")

        tune_config = TuneConfig(
            num_ranks=config.ranks,
            num_microbatches=config.microbatches,
            time_budget_s=config.tune_budget_s,
            min_gain=config.min_gain,
        )
        tuned = pipeline.tune_reference(profile, tune_config, progress=tuning)
        step.done(f"tuned: {tuned.description} ({tuned.evaluations} simulations, {tuned.seconds:.1f} s)")

        baseline = pipeline.baseline_plan(
            reference, num_ranks=config.ranks, num_microbatches=config.microbatches, names=names
        )
        for plan in (tuned.plan, baseline):  # with the costs the tuner scored and set the caps by
            verify_plan(plan, local_cost_model(plan, profile))

        # no plan beats 1F1B by more than the simulator's error: run 1F1B alone, claim no speed-up
        only_1f1b = _same_schedule(tuned.plan, baseline)
        rounds = f"{config.rounds} round{'s' if config.rounds > 1 else ''}"
        what = "1F1B (the tuner's choice)" if only_1f1b else "tuned and 1F1B alternately"
        step = _Step(progress, f"run {what}: {rounds} x {config.steps} steps each")
        results = _run_plans(
            [baseline] * config.rounds if only_1f1b else [tuned.plan, baseline] * config.rounds,
            config.steps,
            timeout_s=config.timeout_s,
            pin_cores=config.pin_cores,
            compile=config.compile,
        )
        step.done(f"ran {len(results)} runs of {config.steps} steps through the embedded coordinator")

    # predicted with local_cost_model, the tuner's own costs, so the predicted speed-up is tune's
    base_cmp = pipeline.compare(baseline, profile, results if only_1f1b else results[1::2])
    tuned_cmp = base_cmp if only_1f1b else pipeline.compare(tuned.plan, profile, results[0::2])
    measured_speedup = pipeline.speedup(base_cmp.measured_step_us, tuned_cmp.measured_step_us)
    predicted_speedup = pipeline.speedup(base_cmp.predicted_step_us, tuned_cmp.predicted_step_us)

    files = _write_files(out, tuned.plan, baseline, profile, tuned_cmp, base_cmp, results)
    summary: dict[str, Any] = {
        "workload": config.workload,
        "size": config.size,
        "ranks": config.ranks,
        "microbatches": config.microbatches,
        "tuned": tuned.description,
        "choice": tuned.choice,
        "min_gain": config.min_gain,
        "stages": [{"stage": s.stage_index, "rank": s.rank, "layers": list(s.layer_names)} for s in tuned.plan.stages],
        "link": {"latency_us": link.latency_us, "bandwidth_bytes_per_second": link.bandwidth_bytes_per_second},
        "predicted": {"tuned": estimate_json(tuned.estimate), "baseline_1f1b_equal": estimate_json(tuned.baseline)},
        "comparison": {"tuned": tuned_cmp.as_json(), "baseline_1f1b_equal": base_cmp.as_json()},
        "speedup_over_1f1b_equal": {"measured": measured_speedup, "predicted": predicted_speedup},
        "ran_1f1b_only": only_1f1b,
        "fastest_predicted_speedup": tuned.baseline.step_time_us / tuned.fastest_step_us,
        "losses_equal": all(r.losses == results[0].losses for r in results),
        "compile": config.compile,
        "stage_backends": {str(s): note for s, note in sorted(results[0].stage_backends.items())},
        "files": {k: str(v) for k, v in files.items()},
    }
    (out / "summary.json").write_text(dumps(summary))
    log.info("demo_finished", speedup=round(measured_speedup, 3), out=str(out))
    if console is not None:
        _print_report(console, tuned.plan, profile, tuned.description, tuned_cmp, base_cmp, summary, files)
    return summary


def _same_schedule(a: plan_pb2.Plan, b: plan_pb2.Plan) -> bool:
    """Whether two plans run the same stages on the same ranks in the same order (names aside)."""
    stages = [(tuple(s.layer_names), s.rank) for s in a.stages] == [(tuple(s.layer_names), s.rank) for s in b.stages]
    return stages and [list(r.actions) for r in a.ranks] == [list(r.actions) for r in b.ranks]


def _write_files(
    out: Path,
    plan: plan_pb2.Plan,
    baseline: plan_pb2.Plan,
    profile: profile_pb2.Profile,
    tuned_cmp: Comparison,
    base_cmp: Comparison,
    results: Sequence[RunResult],
) -> dict[str, Path]:
    from octopipe.execute.runtime import write_side_by_side_trace  # noqa: PLC0415

    files = {
        "plan": out / "plan.binpb",
        "plan_text": out / "plan.txt",
        "plan_csv": out / "plan.csv",
        "baseline_text": out / "baseline-1f1b.txt",
        "profile": out / "profile.binpb",
        "trace": out / "trace.json",
        "baseline_trace": out / "trace-1f1b.json",
        "png": out / "timeline.png",
        "summary": out / "summary.json",
    }
    save_plan(plan, files["plan"])
    files["plan_text"].write_text(plan_to_text(plan))
    files["plan_csv"].write_text(plan_to_torch_csv(plan))
    files["baseline_text"].write_text(plan_to_text(baseline))
    save_profile(profile, files["profile"])
    last_tuned, last_base = results[-2], results[-1]
    write_side_by_side_trace(files["trace"], tuned_cmp.simulation, last_tuned, step=len(last_tuned.losses) - 1)
    write_side_by_side_trace(files["baseline_trace"], base_cmp.simulation, last_base, step=len(last_base.losses) - 1)
    try:
        plot_timeline(tuned_cmp.simulation, files["png"], title=f"simulated: {plan.name}")
    except ImportError as exc:  # matplotlib is optional (octopipe-simulate[png])
        structlog.get_logger("octopipe.demo").warning("png_skipped", reason=str(exc))
        del files["png"]
    return files


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _print_report(
    console: Console,
    plan: plan_pb2.Plan,
    profile: profile_pb2.Profile,
    description: str,
    tuned: Comparison,
    base: Comparison,
    summary: dict[str, Any],
    files: dict[str, Path],
) -> None:

    console.print(f"chosen: {summary['choice']}", highlight=False, markup=False)
    stages = Table(title=f"plan: {description}")
    for column in ("stage", "rank", "layers", "predicted F+B+W per micro-batch ms"):
        stages.add_column(column)
    layer_us = {c.layer_name: c for c in profile.layers}
    for stage in plan.stages:
        names = list(stage.layer_names)
        busy = sum(
            layer_us[n].forward_duration_us + layer_us[n].backward_input_duration_us
            + layer_us[n].backward_weight_duration_us
            for n in names if n in layer_us
        )  # fmt: skip
        shown = f"{names[0]} .. {names[-1]} ({len(names)})" if len(names) > 2 else " ".join(names)
        stages.add_row(str(stage.stage_index), str(stage.rank), shown, f"{busy / 1e3:.2f}")
    console.print(stages)
    console.print("schedule: compute actions per rank (torch.distributed.pipelining text)", highlight=False)
    grid = format_grid(plan, compute_only=True)
    if max(len(line) for line in grid.splitlines()) <= console.width:
        console.print(grid, highlight=False, markup=False, end="")
    else:  # too wide for the terminal: one wrapped line per rank
        for rank, actions in sorted(rank_actions(plan).items()):
            text = " ".join(str(a) for a in actions if a.kind.is_compute)
            console.print(f"rank {rank}: {text}", highlight=False, markup=False)

    table = Table(title="predicted (simulator, from the profile) vs measured (median step after warm-up)")
    for column in ("plan", "step ms predicted", "step ms measured", "replayed", "activations predicted", "held"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for name, cmp in (("tuned", tuned), ("1F1B equal", base)):
        table.add_row(
            name,
            f"{cmp.predicted_step_us / 1e3:.1f}",
            f"{cmp.measured_step_us / 1e3:.1f}",
            f"{cmp.replay_step_us / 1e3:.1f}",
            _size(max(cmp.predicted_activation_bytes)),
            _size(max(cmp.measured_activation_bytes)),
        )
    console.print(table)
    static = max(r.static_memory_bytes for r in tuned.simulation.estimate.ranks)
    measured = (
        f"measured by the allocator {_size(max(tuned.measured_memory_bytes))}"
        if tuned.measured_memory_bytes
        else "not measured by the allocator here (bench/simulator_fidelity.py does); activations above are the "
        "runtime's own count"
    )
    console.print(
        f"peak memory per rank (max over ranks), parameters + gradients + optimizer state ({_size(static)}) plus "
        f"activations: predicted {_size(max(tuned.predicted_memory_bytes))}, {measured}\n"
        "replayed: the simulator fed the measured per-action durations (the rest is runtime overhead)",
        highlight=False,
    )
    ratios = "; ".join(
        f"{name}: " + ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in cmp.slowdown.items())
        for name, cmp in (("tuned", tuned), ("1F1B", base))
    )
    console.print(f"measured / profiled time per action: {ratios}", highlight=False)
    notes = {int(stage): note for stage, note in summary["stage_backends"].items()}
    console.print(compile_line(summary["compile"], notes), highlight=False, soft_wrap=True)
    speed = summary["speedup_over_1f1b_equal"]
    if summary["ran_1f1b_only"]:
        console.print(
            f"[bold]no plan beats 1F1B by more than the simulator's {summary['min_gain']:.0%} error[/bold] "
            f"(the fastest predicted {summary['fastest_predicted_speedup']:.2f}x): ran 1F1B with equal layer "
            f"counts only, no speed-up claimed (--min-gain 0 runs the fastest predicted plan)"
        )
    else:
        console.print(
            f"[bold]speed-up over 1F1B with equal layer counts: {speed['measured']:.2f}x measured[/bold] "
            f"(predicted {speed['predicted']:.2f}x; same model, alternating runs; "
            f"losses {'identical' if summary['losses_equal'] else 'DIFFERENT'} across plans)"
        )
    console.print("written:", highlight=False)
    for key, path in files.items():
        note = {"trace": "  (open in https://ui.perfetto.dev: simulated and measured ranks)"}.get(key, "")
        console.print(f"  {path}{note}", highlight=False)
