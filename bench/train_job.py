"""``octopipe train`` as a user meets it: time to the first step, the step overhead of metrics, and how
fast weights load.

What is measured (issue 22's Measure items), on the 2 local CPU ranks, pinned to distinct cores:

1. **Time from ``octopipe train`` to the first step**: a fresh ``octopipe train CONFIG --steps 2 --json``
   process, from just before it starts to the end of step 0 on every rank (the ranks' monotonic clock),
   for the embedded default (nemotronh-16 tiny, 256 token ids) and ``llama-110m`` (a transformers Llama,
   hidden 768, 12 layers, vocabulary 32000, tied embeddings: 109.5 M parameters, saved with
   ``save_pretrained`` and loaded stage by stage). **Cold**: the first run after the OS page cache was
   dropped (``/proc/sys/vm/drop_caches``; where that is not allowed, the JSON says so); **warm**: the
   runs right after. The split into the CLI process's start-up (Python, imports, the launcher) and the
   job (plan, spawn, capture, load, step 0) is recorded.
2. **Step overhead of metrics and logging**: the embedded default's plan through the Python API,
   interleaved rounds with the per-step feed the progress bar and metrics use (``on_step``) and without
   it; median step time over the steps after the first. Writing ``metrics.jsonl`` and the TensorBoard
   events happens after the run, off the step; its time per step is recorded too.
3. **Checkpoint load time per GB**: every tensor of llama-110m (0.44 GB of float32) read by
   ``WeightSource`` from the HF safetensors folder and from an octopipe (torch.distributed.checkpoint)
   checkpoint, cold (page cache dropped) and warm, with every page of every tensor touched (safetensors
   maps the file: a tensor not touched is not read yet).

    .venv/bin/python bench/train_job.py [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from quiet import add_arguments, start, step_summary, write_record
from transformers import LlamaConfig, LlamaForCausalLM

from octopipe.execute.runtime import run_local
from octopipe.execute.runtime.checkpoint import save_checkpoint
from octopipe.execute.runtime.job import peak_gflops, prepare_job, step_rows, write_metrics
from octopipe.execute.runtime.measure import measured_step_times_us
from octopipe.execute.runtime.pretrained import WeightSource
from octopipe.execute.train_config import load_train_config

OUT = Path(__file__).parent / "results" / "train_job.json"
ROOT = Path(__file__).resolve().parent.parent
OCTOPIPE = ROOT / ".venv" / "bin" / "octopipe"


def drop_page_cache() -> bool:
    """Drop the OS page cache (root on Linux); False where not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def save_llama_110m(folder: Path) -> int:
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def first_step(config: Path | None, out: Path) -> dict[str, Any]:
    """One fresh ``octopipe train`` process: seconds from its start to step 0's end on every rank."""
    command = [str(OCTOPIPE), "train", *([str(config)] if config else []), "--steps", "2", "--json"]
    command += ["--out", str(out)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    to_first = report["first_step_end_monotonic_s"] - started
    return {
        "to_first_step_s": to_first,
        "job_to_first_step_s": report["first_step_s"],  # from the job's start inside the process
        "startup_s": to_first - report["first_step_s"],  # Python, imports, config, before the job
        "process_wall_s": wall,
        "rank_cores": report["rank_cores"],
    }


def time_to_first_step(configs: dict[str, Path | None], warm_runs: int, scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config in configs.items():
        dropped = drop_page_cache()
        cold = first_step(config, scratch / f"{name}-cold")
        warm = [first_step(config, scratch / f"{name}-warm{k}") for k in range(warm_runs)]
        out[name] = {
            "cold": cold,
            "cold_page_cache_dropped": dropped,
            "warm": warm,
            "warm_median_to_first_step_s": statistics.median(w["to_first_step_s"] for w in warm),
        }
        print(
            f"{name:>12}: to the first step cold {cold['to_first_step_s']:.2f} s (start-up "
            f"{cold['startup_s']:.2f} s), warm median {out[name]['warm_median_to_first_step_s']:.2f} s"
        )
    return out


def metrics_overhead(rounds: int, steps: int, environment: Any) -> dict[str, Any]:
    config = load_train_config(None)
    job = prepare_job(config, steps)
    gflops = peak_gflops()
    samples: dict[str, list[float]] = {"with_feed": [], "without": []}
    write_s: list[float] = []
    for round_ in range(rounds):
        for arm in ("without", "with_feed") if round_ % 2 == 0 else ("with_feed", "without"):  # interleaved
            seen: list[int] = []
            feed = (lambda timeline, seen=seen: seen.append(timeline.step)) if arm == "with_feed" else None
            result = run_local(job.plan, job.options, on_step=feed)
            environment.record(result.cores)
            samples[arm] += measured_step_times_us(result)[1:]
            if arm == "with_feed":
                assert len(seen) == steps * len(result.timelines), "every rank reports every step"
                started = time.perf_counter()
                with tempfile.TemporaryDirectory() as folder:
                    write_metrics(step_rows(result, job, gflops), Path(folder), tensorboard=True)
                write_s.append((time.perf_counter() - started) / steps)
    with_feed, without = (step_summary(samples[k]) for k in ("with_feed", "without"))
    overhead = with_feed["median_ms"] / without["median_ms"] - 1.0
    feed_us = _feed_cost_us(result.timelines[0][-1])
    written = statistics.median(write_s) * 1e3
    direct = feed_us / (without["median_ms"] * 1e3)
    print(
        f"metrics feed: step {with_feed['median_ms']:.2f} ms with, {without['median_ms']:.2f} ms without "
        f"({overhead:+.2%}, p10-p90 {with_feed['p10_ms']:.0f}-{with_feed['p90_ms']:.0f} vs "
        f"{without['p10_ms']:.0f}-{without['p90_ms']:.0f}); the feed's own work per step on a rank "
        f"{feed_us:.0f} us = {direct:.3%} of a step; writing metrics.jsonl + TensorBoard after the run: "
        f"{written:.3f} ms per step"
    )
    return {
        "with_feed": with_feed,
        "without": without,
        "overhead": overhead,
        "feed_us_per_step_per_rank": feed_us,
        "feed_share_of_step": direct,
        "write_ms_per_step_after_run": written,
    }


def _feed_cost_us(timeline: Any, repeats: int = 200) -> float:
    """What the feed costs a rank per step, measured directly: a step's timeline put on a multiprocessing
    queue and taken off it by another process (the rank's put and its feeder thread's pickling and write),
    median of ``repeats``, in microseconds."""
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        events.put(timeline)
        events.get(timeout=10)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def load_speed(folder: Path, scratch: Path, repeats: int) -> dict[str, Any]:
    source = WeightSource(folder)
    loaded = source.read(source.meta())
    gigabytes = sum(t.nbytes for t in loaded.values()) / 1e9
    params = {n: torch.nn.Parameter(t) for n, t in loaded.items()}
    save_checkpoint(scratch / "ckpt", 1, params, torch.optim.AdamW(params.values()))  # parameters only
    del params, loaded
    out: dict[str, Any] = {"gigabytes": gigabytes}
    for kind, path in (("hf_safetensors", folder), ("octopipe_checkpoint", scratch / "ckpt" / "step-1")):
        chosen = WeightSource(path)
        shapes = chosen.meta()
        figures = {}
        for state in ("cold", "warm"):
            times = []
            for _ in range(repeats if state == "warm" else 1):
                dropped = drop_page_cache() if state == "cold" else None
                started = time.perf_counter()
                tensors = chosen.read(shapes)
                touched = sum(float(t.view(-1)[:: max(1, 4096 // t.element_size())].sum()) for t in tensors.values())
                times.append(time.perf_counter() - started)  # with every page touched: read, not only mapped
                del tensors, touched
            figures[state] = {"seconds_per_gb": statistics.median(times) / gigabytes, "runs": len(times)}
            if dropped is not None:
                figures[state]["page_cache_dropped"] = dropped
        out[kind] = figures
        print(
            f"{kind:>20}: load {figures['cold']['seconds_per_gb']:.2f} s/GB cold, "
            f"{figures['warm']['seconds_per_gb']:.2f} s/GB warm ({gigabytes:.2f} GB)"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, rounds=3, steps=12)
    parser.add_argument("--warm-runs", type=int, default=2)
    args = parser.parse_args()
    environment = start(parser, args)
    record: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    with tempfile.TemporaryDirectory(prefix="octopipe-train-bench-") as scratch_name:
        scratch = Path(scratch_name)
        record["llama_110m_parameters"] = save_llama_110m(scratch / "llama-110m")
        config = scratch / "llama-110m.toml"
        config.write_text(
            f"[model]\nhf = '{scratch / 'llama-110m'}'\nsequence = 128\nglobal_batch = 4\n"
            "[plan]\nschedule = '1f1b'\nmicrobatches = 2\n[metrics]\ntensorboard = false\n"
        )
        record["load"] = load_speed(scratch / "llama-110m", scratch, repeats=3)
        record["first_step"] = time_to_first_step(
            {"default": None, "llama-110m": config}, args.warm_runs, scratch / "runs"
        )
        for entry in record["first_step"].values():
            for run in (entry["cold"], *entry["warm"]):
                environment.record({int(r): c for r, c in run["rank_cores"].items()})
        record["metrics_overhead"] = metrics_overhead(args.rounds, args.steps, environment)
    record["environment"] = environment.finish()
    write_record(OUT, record)


if __name__ == "__main__":
    main()
