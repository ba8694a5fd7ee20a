"""``octopipe train``'s job through the Python API: a checked ``TrainConfig`` in; the run, a metrics row
per step (``metrics.jsonl`` and TensorBoard event files) and a summary out.

``prepare_job`` turns the config into what runs: the model (a zoo workload, a transformers checkpoint
folder -- its weights loaded stage by stage --, or ``package.module:function``), the plan (a file,
1F1B / ZB-H1 on equal layer counts, or the tuner's: the model's layers profiled, then partition x
placement x schedule searched), and the run's options. ``train`` runs it on local CPU ranks and
writes, per step: loss, learning rate, gradient norm, step time (first rank's start to last rank's end),
tokens/s, MFU (the captured graphs' matmul and attention FLOPs over the step time and the ranks' peak),
the measured bubble (the share of the step a rank's compute stream was idle, averaged over ranks) and
each rank's peak resident memory and held activation bytes; given a profile of the model, the
simulator's predicted step time and bubble beside them. ``peak_gflops`` measures one core's fp32
matmul rate when the config does not give it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from octopipe.execute.runs import RunOptions, RunResult, StepTimeline
from octopipe.execute.runtime.launcher import merge_results, run_local
from octopipe.execute.runtime.measure import measured_step_times_us
from octopipe.execute.runtime.models import build_model, workload_reference
from octopipe.execute.runtime.pipeline import baseline_plan, profile_reference, tune_reference
from octopipe.execute.runtime.pretrained import params_on_meta
from octopipe.execute.train_config import TrainConfig
from octopipe.execute.training import WeightsSpec
from octopipe.ir import load_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate, local_cost_model, simulate
from octopipe.tune import TuneConfig

__all__ = [
    "CAUSAL_LM_SOURCE",
    "TrainJob",
    "TrainSummary",
    "gather_rank_results",
    "peak_gflops",
    "prepare_job",
    "step_rows",
    "summarize",
    "train",
    "write_metrics",
]

#: the model source of a transformers checkpoint folder (``[model] hf``)
CAUSAL_LM_SOURCE = "octopipe.execute.runtime.pretrained:causal_lm"


@dataclass(frozen=True)
class TrainJob:
    """What a config runs: the plan (its model inside), the run's options, tokens per step."""

    plan: plan_pb2.Plan
    options: RunOptions
    tokens_per_step: int
    #: the profile a tuned plan was searched on (``[plan] schedule = "tune"``): its predictions come with it
    profile: profile_pb2.Profile | None = None


@dataclass
class TrainSummary:
    """What a job did: the run's result, a metrics row per step, where they were written."""

    result: RunResult
    rows: list[dict[str, Any]]
    metrics: Path
    tensorboard: Path | None
    #: seconds from ``train``'s start to the end of the first step on every rank
    first_step_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _reference(config: TrainConfig) -> plan_pb2.ModelReference:
    model = config.section("model")
    sizes = {"sequence": str(model["sequence"]), "global_batch": str(model["global_batch"])}
    if model["hf"] and model["source"]:
        raise ValueError("[model] hf and source both name a model: give one")
    if model["hf"]:
        reference = plan_pb2.ModelReference(name=Path(model["hf"]).name or model["hf"], source=CAUSAL_LM_SOURCE)
        reference.config.update({"path": model["hf"], **sizes})
        return reference
    if model["source"]:
        reference = plan_pb2.ModelReference(name=model["source"], source=model["source"])
        reference.config.update(
            {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in model["options"].items()}
        )
        return reference
    return workload_reference(
        model["workload"],
        tiny=model["tiny"],
        vocab=model["vocab"],
        sequence=model["sequence"],
        global_batch=model["global_batch"],
    )


def prepare_job(config: TrainConfig, steps: int | None = None) -> TrainJob:
    """The plan and options ``config`` names (``steps`` overrides ``[run] steps``)."""
    steps = steps if steps is not None else config.steps
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    plan_keys, run_keys, model = config.section("plan"), config.section("run"), config.section("model")
    reference = _reference(config)
    profile = None
    if plan_keys["file"]:
        plan = load_plan(Path(plan_keys["file"]))
        if plan.model.SerializeToString(deterministic=True) != reference.SerializeToString(deterministic=True):
            raise ValueError(f"[plan] file {plan_keys['file']} names another model than [model]: make them agree")
    elif plan_keys["schedule"] == "tune":  # this model's layers profiled here, then the tuner's search
        ranks, m = plan_keys["ranks"], plan_keys["microbatches"]
        profile = profile_reference(reference, num_microbatches=m, num_ranks=ranks)
        search = TuneConfig(
            num_ranks=ranks, num_microbatches=m, time_budget_s=plan_keys["tune_budget_s"], min_gain=0.05
        )
        plan = tune_reference(profile, search).plan
    else:
        plan = baseline_plan(
            reference,
            num_ranks=plan_keys["ranks"],
            num_microbatches=plan_keys["microbatches"],
            schedule=plan_keys["schedule"],
        )
    weights = config.section("weights")
    load = weights["load"] or model["hf"]  # a transformers folder's own weights, unless told otherwise
    with params_on_meta():  # the batch's shape, without the weights
        inputs, _ = build_model(plan.model).batch(0)
    options = RunOptions(
        steps=steps,
        seed=run_keys["seed"],
        timeout_s=max(run_keys["timeout_s"], 1.0),
        optimization=config.optimization(steps),
        data=config.data() if config.section("data")["enabled"] else None,
        weights=WeightsSpec(load=load, export=weights["export"]) if load or weights["export"] else None,
        checkpoint_dir=run_keys["checkpoint_dir"],
        checkpoint_every=run_keys["checkpoint_every"],
        checkpoint_async=run_keys["checkpoint_async"],
        checkpoint_keep=run_keys["checkpoint_keep"],
        compile=run_keys["compile"],
    )
    return TrainJob(plan=plan, options=options, tokens_per_step=int(inputs.numel()), profile=profile)


def peak_gflops(seconds: float = 0.3, size: int = 512) -> float:
    """One core's fp32 matmul rate (best of repeated ``size``-square products, one thread), GFLOP/s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        best, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2.0 * size**3 / best / 1e9
    finally:
        torch.set_num_threads(threads)


def _compute_busy_ns(step: StepTimeline) -> int:
    return sum(r.end_ns - r.start_ns for r in step.records if r.stream == "compute")


def step_rows(
    result: RunResult, job: TrainJob, gflops_per_rank: float, predicted: Estimate | None = None
) -> list[dict[str, Any]]:
    """A metrics row per step (see the module docstring); ``predicted``: the simulator's step, beside."""
    times_us = measured_step_times_us(result)
    flops = sum(result.flops_per_step.values()) if len(result.flops_per_step) == len(result.timelines) else None
    peak = gflops_per_rank * 1e9 * len(result.timelines)
    rows = []
    for step, loss in enumerate(result.losses):
        seconds = times_us[step] / 1e6
        row: dict[str, Any] = {"step": step, "loss": loss, "learning_rate": job.options.optimization.lr_at(step)}
        if result.grad_norms:
            row["grad_norm"] = result.grad_norms[step]
        row["step_ms"] = seconds * 1e3
        row["tokens_per_s"] = job.tokens_per_step / seconds
        if flops is not None and peak > 0:
            row["mfu"] = flops / seconds / peak
        bubbles, rss, held = [], {}, {}
        for rank, steps in sorted(result.timelines.items()):
            bubbles.append(1.0 - _compute_busy_ns(steps[step]) / (times_us[step] * 1e3))
            rss[str(rank)] = max((r.rss_bytes for r in steps[step].records), default=0) / 2**20
            held[str(rank)] = max((r.held_bytes for r in steps[step].records), default=0) / 2**20
        row["bubble"] = sum(bubbles) / len(bubbles)
        if predicted is not None:
            row["predicted_step_ms"] = predicted.step_time_us / 1e3
            row["predicted_bubble"] = predicted.bubble_ratio
        row["peak_rss_mib"] = rss
        row["peak_held_mib"] = held
        rows.append(row)
    return rows


def write_metrics(rows: list[dict[str, Any]], out: Path, tensorboard: bool) -> tuple[Path, Path | None]:
    """``out/metrics.jsonl`` and, with ``tensorboard``, event files under ``out/tensorboard``."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    with metrics.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    if not tensorboard:
        return metrics, None
    try:
        from tensorboardX import SummaryWriter  # type: ignore[import-untyped]  # noqa: PLC0415 - optional
    except ImportError:
        raise ValueError(
            "[metrics] tensorboard needs tensorboardX: pip install 'octopipe-execute[tensorboard]', or set "
            "[metrics] tensorboard = false"
        ) from None
    folder = out / "tensorboard"
    writer = SummaryWriter(str(folder))
    try:
        for row in rows:
            for key, value in row.items():
                if key == "step":
                    continue
                if isinstance(value, dict):
                    for rank, figure in value.items():
                        writer.add_scalar(f"{key}/rank{rank}", figure, row["step"])
                else:
                    writer.add_scalar(key, value, row["step"])
    finally:
        writer.close()
    return metrics, folder


def train(
    config: TrainConfig,
    *,
    steps: int | None = None,
    out: Path = Path("out/train"),
    on_step: Callable[[StepTimeline], None] | None = None,
    profile: profile_pb2.Profile | None = None,
) -> TrainSummary:
    """Run ``config``'s job on local CPU ranks and write its metrics under ``out``. ``profile`` (of this
    model, ``octopipe profile``): the simulator predicts each step's time and bubble beside the measured."""
    started = time.monotonic()
    job = prepare_job(config, steps)
    result = run_local(job.plan, job.options, on_step=on_step)
    return summarize(config, job, result, out, started=started, profile=profile or job.profile)


def summarize(
    config: TrainConfig,
    job: TrainJob,
    result: RunResult,
    out: Path,
    *,
    started: float,
    profile: profile_pb2.Profile | None = None,
) -> TrainSummary:
    """The metrics rows of a finished run, written under ``out``; ``started``: the job's start (monotonic s)."""
    metrics_keys = config.section("metrics")
    gflops = metrics_keys["peak_gflops"] or peak_gflops()
    predicted = simulate(job.plan, local_cost_model(job.plan, profile)).estimate if profile is not None else None
    first_end = max(steps_[0].end_ns for steps_ in result.timelines.values()) / 1e9
    rows = step_rows(result, job, gflops, predicted)
    metrics, tensorboard = write_metrics(rows, out, metrics_keys["tensorboard"])
    return TrainSummary(
        result=result,
        rows=rows,
        metrics=metrics,
        tensorboard=tensorboard,
        first_step_s=first_end - started,
        extra={
            "peak_gflops_per_rank": gflops,
            "plan": job.plan.name,
            "tokens_per_step": job.tokens_per_step,
            "first_step_end_monotonic_s": first_end,
        },
    )


def gather_rank_results(folder: Path, plan: plan_pb2.Plan, world: int, timeout_s: float) -> RunResult | None:
    """A torchrun launch's RunResult from its ranks' result files in ``folder`` (``rank<r>.pt``), waiting up
    to ``timeout_s`` for every one to be whole; None when some never are (ranks on machines that do not
    share the folder)."""
    deadline = time.monotonic() + timeout_s
    paths = [folder / f"rank{r}.pt" for r in range(world)]
    while True:
        try:
            results = [torch.load(p, weights_only=True, map_location="cpu") for p in paths]
            return merge_results([plan], results)[0]
        except (OSError, EOFError, RuntimeError):  # not there yet, or still being written
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
