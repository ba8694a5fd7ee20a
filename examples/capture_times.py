"""Capture time per model and stage count, and the numerics guard's cost relative to one step (CPU).

Run: .venv/bin/python examples/capture_times.py   (prints a Markdown table)
"cold" is the first whole-model trace in the process; "warm" a second trace of the
same model; "stages" is capturing every stage (AOTAutograd joint graph + B/W split),
which the runtime's capture cache then reuses ("cached": a lookup, ~0 s).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octopipe.capture import check_numerics, split_graph, trace_model
from octopipe.transform import compile_stage
from tests.capture.whole_model import example_activations
from tests.hf_models import FAMILIES as HF

MODELS: dict[str, Callable[[], Any]] = {
    "Llama (tied)": partial(HF["llama_tied"], "sdpa"),
    "Qwen3MoE (aux loss)": partial(HF["qwen3moe"], "sdpa"),
    "Gemma3": partial(HF["gemma3"], "sdpa"),
    "GPT2": partial(HF["gpt2"], "sdpa"),
    "FalconH1": partial(HF["falcon_h1"], "sdpa"),
    "DeepseekV3": partial(HF["deepseek_v3"], "sdpa"),
}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    print(  # noqa: T201 -- a script that prints a table
        "| model | trace cold s | trace warm s | stages | capture stages s | one step s (median) | guard s (median) | guard/step |"
    )
    print("|---|---|---|---|---|---|---|---|")  # noqa: T201
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build()
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "labels": ids}
        start = time.perf_counter()
        graph = trace_model(model, inputs)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        graph = trace_model(model, inputs)
        warm = time.perf_counter() - start
        names = list(graph.layers)
        for partition in ([names[: len(names) // 2], names[len(names) // 2 :]], [names[:2], names[2:4], names[4:]]):
            stages = split_graph(graph, partition, allow_tied=True)
            examples = example_activations(stages, graph)
            start = time.perf_counter()
            executables = [compile_stage(stage, examples[s], stage_index=s) for s, stage in enumerate(stages)]
            captured = time.perf_counter() - start
            steps, guards = [], []
            for _ in range(5):  # medians of 5: these 2-core machines are noisy
                start = time.perf_counter()  # one step: F of every stage, then the fused backward in reverse
                contexts, values = [], examples[0]
                for s, exe in enumerate(executables):
                    values, ctx = exe.forward_all(examples[s] if s else values)
                    contexts.append(ctx)
                grads: list[torch.Tensor | None] = [torch.ones_like(values[0])]
                for s in reversed(range(len(stages))):
                    input_grads, _ = executables[s].full_backward_all(contexts[s], grads)
                    grads = list(input_grads[: len(stages[s - 1].output_names)]) if s else []
                steps.append(time.perf_counter() - start)
                forwards = [lambda xs, exe=exe: exe.forward_all(xs)[0] for exe in executables]
                guards.append(check_numerics(graph, stages, inputs, forwards=forwards).seconds)
            step, guard = statistics.median(steps), statistics.median(guards)
            print(  # noqa: T201
                f"| {name} | {cold:.2f} | {warm:.2f} | {len(stages)} | {captured:.2f} | {step:.3f} | "
                f"{guard:.3f} | {guard / step:.1f}x |"
            )


if __name__ == "__main__":
    main()
