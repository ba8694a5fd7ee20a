"""Compiled stages per block: octopipe's Inductor-compiled F, I and W against torch eager's forward and backward.

One Llama block, one MoE block and one Mamba block at shared/benchmarks.md's sizes (hidden 256, 8
heads, FFN 688, 8 experts top-2, sequence 128, micro-batch 4, fp32), one thread, the process pinned to
one core. Per round, interleaved: torch eager's forward and fused backward (autograd); octopipe's eager
F, I, W (the captured, split graphs); octopipe's compiled F, I, W (``StageCompiler(backend="inductor")``).
``--repeats`` rounds after ``--warmup``; medians and p10-p90 in ms. Goals (issue 20): compiled
F <= 0.85x torch eager forward, compiled I + W <= 0.85x torch eager backward.

Compile time per block: cold (a fresh, empty Inductor cache folder) and warm (the same stage compiled
again by a new compiler, so only Inductor's on-disk cache is shared).

    .venv/bin/python bench/compiled_blocks.py [--repeats 15] [--blocks llama moe mamba]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from quiet import percentile, require_quiet, write_record

from octopipe.capture import StageModule, pipeline_spec
from octopipe.examples.models import DecoderLM, ModelConfig
from octopipe.transform import StageCompiler, StageExecutable

BLOCKS = {"llama": ("attention", "swiglu"), "moe": ("attention", "moe"), "mamba": ("mamba", "none")}
OUT = Path(__file__).parent / "results" / "compiled_blocks.json"


def _compile(stage: StageModule, x: torch.Tensor) -> tuple[StageExecutable, float]:
    started = time.perf_counter()
    exe = StageCompiler(backend="inductor").compile(stage, [x], stage_index=1).bind(stage)
    return exe, time.perf_counter() - started


def bench_block(name: str, *, repeats: int, warmup: int, sequence: int, batch: int) -> dict[str, Any]:
    config = ModelConfig()
    torch.manual_seed(0)
    model = DecoderLM([BLOCKS[name]], config)
    stage = StageModule(model, [pipeline_spec(model).layers[1]], stage_index=1, num_stages=3, loss=None)
    x = torch.randn(batch, sequence, config.hidden)
    grad = torch.randn(batch, sequence, config.hidden)
    eager = StageCompiler().compile(stage, [x], stage_index=1).bind(stage)
    cold_dir = tempfile.mkdtemp(prefix="octopipe-inductor-cold-")
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cold_dir
    try:
        torch._dynamo.reset()
        compiled, cold_s = _compile(stage, x)
        _, warm_s = _compile(stage, x)
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    params = list(stage.parameters())
    keys = ("torch_f", "torch_b", "eager_f", "eager_i", "eager_w", "compiled_f", "compiled_i", "compiled_w")
    times: dict[str, list[float]] = {k: [] for k in keys}

    def timed(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        result = fn(*args)
        times[key].append((time.perf_counter() - started) * 1e3)
        return result

    for index in range(warmup + repeats):
        for p in params:
            p.grad = None
        xin = x.detach().requires_grad_()
        y = timed("torch_f", stage, xin)
        timed("torch_b", torch.autograd.backward, y, grad)
        for prefix, exe in (("eager", eager), ("compiled", compiled)):
            _, ctx = timed(f"{prefix}_f", exe.forward, [x])
            _, wctx = timed(f"{prefix}_i", exe.backward_input, ctx, grad)
            timed(f"{prefix}_w", exe.backward_weight, wctx)
        if index < warmup:
            for values in times.values():
                values.clear()

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9)}

    split = {
        prefix: [i + w for i, w in zip(times[f"{prefix}_i"], times[f"{prefix}_w"], strict=True)]
        for prefix in ("eager", "compiled")
    }
    row: dict[str, Any] = {"block": name, **{f"{k}_ms": summary(v) for k, v in times.items()}}
    row["eager_i_plus_w_ms"] = summary(split["eager"])
    row["compiled_i_plus_w_ms"] = summary(split["compiled"])
    row["compiled_f_vs_torch_forward"] = statistics.median(times["compiled_f"]) / statistics.median(times["torch_f"])
    row["compiled_i_plus_w_vs_torch_backward"] = statistics.median(split["compiled"]) / statistics.median(
        times["torch_b"]
    )
    row["compile_cold_s"] = cold_s
    row["compile_warm_s"] = warm_s
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
    parser.add_argument("--max-load", type=float, default=0.8)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    load_before = require_quiet(args.max_load, force=args.force)
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    rows = [
        bench_block(b, repeats=args.repeats, warmup=args.warmup, sequence=args.sequence, batch=args.batch)
        for b in args.blocks
    ]
    print(
        f"compiled blocks, fp32, 1 thread on core {core}, micro-batch {args.batch} x {args.sequence}, hidden 256; "
        f"median ms over {args.repeats} interleaved rounds"
    )
    print(
        f"{'block':<6} {'torch F':>8} {'torch B':>8} {'eager F':>8} {'eager I+W':>10} {'comp F':>8} {'comp I':>8} "
        f"{'comp W':>8} {'comp I+W':>9} {'F ratio':>8} {'I+W ratio':>10} {'cold s':>7} {'warm s':>7}"
    )
    for r in rows:
        print(
            f"{r['block']:<6} {r['torch_f_ms']['median']:>8.2f} {r['torch_b_ms']['median']:>8.2f} "
            f"{r['eager_f_ms']['median']:>8.2f} {r['eager_i_plus_w_ms']['median']:>10.2f} "
            f"{r['compiled_f_ms']['median']:>8.2f} {r['compiled_i_ms']['median']:>8.2f} "
            f"{r['compiled_w_ms']['median']:>8.2f} {r['compiled_i_plus_w_ms']['median']:>9.2f} "
            f"{r['compiled_f_vs_torch_forward']:>8.3f} {r['compiled_i_plus_w_vs_torch_backward']:>10.3f} "
            f"{r['compile_cold_s']:>7.1f} {r['compile_warm_s']:>7.1f}"
        )
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "meta": {
            "torch": torch.__version__,
            "threads": 1,
            "core": core,
            "batch": args.batch,
            "sequence": args.sequence,
        },
        "rows": rows,
        "environment": {
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
            "forced_while_busy": args.force,
        },
    }
    write_record(OUT, record)


if __name__ == "__main__":
    main()
