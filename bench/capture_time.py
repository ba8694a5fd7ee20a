"""Whole-model capture on a rank: capture time per family and stage count, cold and with the capture cache,
and the launch guard's cost as a fraction of one training step (CPU, one thread, as a rank runs).

Run: .venv/bin/python bench/capture_time.py   (prints a table, writes bench/results/capture_time.json)

What a rank does for a whole-model plan (runtime.worker): ``whole_model_stages`` (trace the model's
own call once, split it at the plan's layers, one eager pass for example inputs) and, per stage it
holds, the capture cache's ``executable`` (AOTAutograd joint capture + B/W split on a miss; a dict
lookup on a hit). Cold = an empty cache (the first plan of a launch); cached = the next plan with the
same layout (``run_local_many``): the trace and split run again, every stage is a cache hit. Here one
process does every stage, i.e. the sum of what the ranks do. Step = one training step of m = 2
micro-batches through every stage (F, then the fused backward, as the runtime's executables run them).
Guard = ``runtime.whole_model.guard`` with every stage as run (a rank runs the same with the other
ranks' stages eager, so no more than this). Medians of ``REPEATS`` runs.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quiet import require_quiet

from octopipe.capture import trace_model
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.execute.runtime.stages import stage_key
from octopipe.execute.runtime.whole_model import guard, whole_model_stages
from octopipe.transform import StageCompiler, StageExecutable
from tests.hf_models import FAMILIES as HF

REPEATS = 3
MODELS: dict[str, Callable[[], Any]] = {
    "Llama (tied), 3 layers": partial(HF["llama_tied"], "sdpa"),
    "Qwen3MoE (aux loss), 3 layers": partial(HF["qwen3moe"], "sdpa"),
    "Gemma3, 4 layers": partial(HF["gemma3"], "sdpa"),
    "GPT2, 3 layers": partial(HF["gpt2"], "sdpa"),
    "FalconH1, 3 layers": partial(HF["falcon_h1"], "sdpa"),
    "DeepseekV3, 3 layers": partial(HF["deepseek_v3"], "sdpa"),
}
NAMES = ("input_ids", "labels")


def split(names: tuple[str, ...], parts: int) -> list[list[str]]:
    size = -(-len(names) // parts)
    return [list(names[i : i + size]) for i in range(0, len(names), size)]


def step_seconds(exes: dict[int, StageExecutable], microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One step: each micro-batch forward through every stage, then its fused backward (loss scaled by 1/m)."""
    start = time.perf_counter()
    scale = torch.ones(()) / len(microbatches)
    for x, y in microbatches:
        values, contexts = [x], []
        for s in sorted(exes):
            inputs = [*values, y] if s == len(exes) - 1 else values
            values, ctx = exes[s].forward_all(inputs)
            contexts.append(ctx)
        grads: list[torch.Tensor | None] = [scale]
        for s in reversed(sorted(exes)):
            input_grads, _ = exes[s].full_backward_all(contexts[s], grads)
            grads = list(input_grads[: exes[s - 1].graphs.num_outputs]) if s > 0 else []
    return time.perf_counter() - start


def measure(name: str, build: Callable[[], Any], stages: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
    microbatches = list(zip(ids.chunk(2), ids.chunk(2), strict=True))
    layers = trace_model(model, dict(zip(NAMES, microbatches[0], strict=True))).layers  # the discovered layers
    cold: list[float] = []
    cached: list[float] = []
    steps: list[float] = []
    guards: list[float] = []
    for _ in range(REPEATS):
        cache = StageCompiler()
        for round_ in ("cold", "cached"):
            start = time.perf_counter()
            whole = whole_model_stages(model, NAMES, microbatches[0], split(layers, stages))
            exes = {
                s: cache.executable(
                    stage, whole.examples[s], stage_index=s, key=stage_key(stage, whole.examples[s], b"")
                )
                for s, stage in enumerate(whole.stages)
            }
            (cold if round_ == "cold" else cached).append(time.perf_counter() - start)
        steps.append(step_seconds(exes, microbatches))
        start = time.perf_counter()
        guard(whole, exes, microbatches[0], NAMES)
        guards.append(time.perf_counter() - start)
    step, guard_s = statistics.median(steps), statistics.median(guards)
    return {
        "model": name,
        "stages": stages,
        "boundary_tensors": [len(stage.output_names) for stage in whole.stages[:-1]],
        "cold_s": statistics.median(cold),
        "cached_s": statistics.median(cached),
        "step_s": step,
        "guard_s": guard_s,
        "guard_per_step": guard_s / step,
    }


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # the table only
    force = "--force" in sys.argv[1:]
    require_quiet(force=force)  # a figure under contention is not a result (--force records that it was)
    cores, _ = pin_rank(0)  # one core of the machine's online CPUs, as a rank runs
    torch.set_num_threads(1)  # as on every rank
    torch.use_deterministic_algorithms(True)  # as the MoE families need for bitwise guards; the same for all
    load_before = os.getloadavg()[0]
    rows = [measure(name, build, stages) for name, build in MODELS.items() for stages in (2, 3)]
    load_after = os.getloadavg()[0]
    header = "| model | stages | tensors crossing | capture cold s | capture cached s | step s (m=2) | guard s | guard/step |"
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['stages']} | {row['boundary_tensors']} | {row['cold_s']:.2f} | "
            f"{row['cached_s']:.2f} | {row['step_s']:.3f} | {row['guard_s']:.3f} | {row['guard_per_step']:.2f} |"
        )
    out = Path(__file__).resolve().parent / "results" / "capture_time.json"
    record = {
        "repeats": REPEATS,
        "threads": 1,
        "cores": cores,
        "forced_while_busy": force,
        "load_1min": [load_before, load_after],
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"1-minute load average {load_before:.2f} before, {load_after:.2f} after (2 cores)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
