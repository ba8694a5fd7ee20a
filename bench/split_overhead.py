"""Split overhead: (time B + time W) / time of the fused backward, ours and torch.distributed.pipelining's.

For one Llama block, one MoE block and one Mamba block at shared/benchmarks.md's
sizes (hidden 256, 8 heads, FFN 688, 8 experts top-2, sequence 128, micro-batch
4, fp32, one thread pinned to one core). All variants run interleaved in one
process, ``--repeats`` times after ``--warmup`` rounds; the table shows medians
and the spread (10th-90th percentile) in ms.

- ours: the captured stage's fused backward graph vs its B graph + W graph;
- torch: eager autograd's fused backward vs ``stage_backward_input`` +
  ``stage_backward_weight`` (torch.distributed.pipelining's autograd-based split).

Also: bytes held between B and W per micro-batch (our W context) against the
activations the forward saved (what the fused backward holds when it starts).

    .venv/bin/python bench/split_overhead.py [--repeats 15] [--blocks llama moe mamba]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from octopipe.capture import StageModule, capture_stage, pipeline_spec
from octopipe.examples.models import DecoderLM, ModelConfig
from octopipe.transform import Device, StageExecutable, storage_bytes

BLOCKS = {"llama": ("attention", "swiglu"), "moe": ("attention", "moe"), "mamba": ("mamba", "none")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def bench_block(
    name: str, *, repeats: int, warmup: int, sequence: int, batch: int, device: str = "cpu", dtype: str = "float32"
) -> dict[str, object]:
    config = ModelConfig()
    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    model = DecoderLM([BLOCKS[name]], config).to(device=device, dtype=kind)
    spec = pipeline_spec(model)
    layer = spec.layers[1]
    stage = StageModule(model, [layer], stage_index=1, num_stages=3, loss=None)
    x = torch.randn(batch, sequence, config.hidden, device=device, dtype=kind)
    exe = StageExecutable.from_module(stage, capture_stage(stage, [x], stage_index=1))
    grad = torch.randn(batch, sequence, config.hidden, device=device, dtype=kind)
    where = Device.parse(device)
    params = list(stage.parameters())
    times: dict[str, list[float]] = {
        k: [] for k in ("ours_fused", "ours_b", "ours_w", "torch_fused", "torch_i", "torch_w")
    }

    def timed(key: str, fn: Callable[..., Any], *args: Any) -> Any:
        watch = where.stopwatch()  # CUDA events on a GPU, the host clock on CPU
        watch.mark()
        result = fn(*args)
        watch.mark()
        times[key].append(watch.elapsed_us(0, 1) / 1e3)
        return result

    held = saved = 0
    for index in range(warmup + repeats):
        # ours, fused
        _, ctx = exe.forward([x])
        timed("ours_fused", exe.full_backward, ctx, grad)
        # ours, split
        _, ctx = exe.forward([x])
        saved = storage_bytes(ctx.saved or [], exclude=[*exe.params, *exe.buffers])
        _, wctx = timed("ours_b", exe.backward_input, ctx, grad)
        held = storage_bytes(wctx.tensors or [], exclude=[*exe.params, *exe.buffers])
        timed("ours_w", exe.backward_weight, wctx)
        # torch autograd, fused
        for p in params:
            p.grad = None
        xin = x.detach().requires_grad_()
        y = stage(xin)
        timed("torch_fused", torch.autograd.backward, y, grad)
        # torch.distributed.pipelining's split
        for p in params:
            p.grad = None
        xin = x.detach().requires_grad_()
        y = stage(xin)
        _, groups = timed("torch_i", stage_backward_input, [y], [grad], [xin], iter(params))
        timed("torch_w", stage_backward_weight, iter(params), groups)
        if index < warmup:
            for values in times.values():
                values.clear()
    ours_split = [b + w for b, w in zip(times["ours_b"], times["ours_w"], strict=True)]
    torch_split = [i + w for i, w in zip(times["torch_i"], times["torch_w"], strict=True)]
    ours_ratio = [s / f for s, f in zip(ours_split, times["ours_fused"], strict=True)]
    torch_ratio = [s / f for s, f in zip(torch_split, times["torch_fused"], strict=True)]

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9)}

    return {
        "block": name,
        "ours_fused_ms": summary(times["ours_fused"]),
        "ours_b_ms": summary(times["ours_b"]),
        "ours_w_ms": summary(times["ours_w"]),
        "ours_ratio": summary(ours_ratio),
        "torch_fused_ms": summary(times["torch_fused"]),
        "torch_split_ms": summary(torch_split),
        "torch_ratio": summary(torch_ratio),
        "saved_by_forward_bytes": saved,
        "held_between_b_and_w_bytes": held,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "split_overhead.json")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    rows = [
        bench_block(
            b,
            repeats=args.repeats,
            warmup=args.warmup,
            sequence=args.sequence,
            batch=args.batch,
            device=args.device,
            dtype=args.dtype,
        )
        for b in args.blocks
    ]
    print(
        f"split overhead, {args.dtype} on {args.device}, 1 thread, micro-batch {args.batch} x {args.sequence} tokens, hidden 256; median [p10, p90] over {args.repeats} interleaved runs"
    )
    print(
        f"{'block':<7} {'ours fused ms':>15} {'ours B+W/fused':>22} {'torch fused ms':>15} {'torch I+W/fused':>22} {'F saved MiB':>12} {'B->W MiB':>9}"
    )
    for r in rows:
        of, oratio, tf, tratio = r["ours_fused_ms"], r["ours_ratio"], r["torch_fused_ms"], r["torch_ratio"]
        assert isinstance(of, dict) and isinstance(oratio, dict) and isinstance(tf, dict) and isinstance(tratio, dict)
        print(
            f"{r['block']:<7} {of['median']:>15.2f} {oratio['median']:>8.3f} [{oratio['p10']:.3f}, {oratio['p90']:.3f}] "
            f"{tf['median']:>15.2f} {tratio['median']:>8.3f} [{tratio['p10']:.3f}, {tratio['p90']:.3f}] "
            f"{float(str(r['saved_by_forward_bytes'])) / 2**20:>12.2f} {float(str(r['held_between_b_and_w_bytes'])) / 2**20:>9.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": 1,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "sequence": args.sequence,
        "repeats": args.repeats,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
