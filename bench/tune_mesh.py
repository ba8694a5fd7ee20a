"""Mesh tuner (pp x dp x m with FSDP collectives) for nemotronh-56b on 1024, 4096 and 8192 devices.

What is measured: the wall and CPU time of ``octopipe.tune.tune_mesh`` (median and spread of
``--runs`` runs, the process pinned to one core; CPU time is the figure a shared machine disturbs less), the configuration it chooses, and the predicted step time, bubble ratio and throughput of
the chosen plan against 1F1B with equal layer counts on the same mesh (same pp, dp, m; collectives
placed the same way). Predictions only: nothing here ran on GPUs.

Workload: ``nemotronh-56b`` of shared/benchmarks.md (the 118-layer pattern, plus embedding and head),
but at its real size, since an 80 GB cap is meaningless for the hidden-256 CPU costs of
bench/tune_workloads.py. Per-layer costs are derived here, analytically, from the published
Nemotron-H 56B shape (hidden 8192; Mamba-2 with 256 heads of 64, state 256, 8 groups, conv 4;
attention 64 heads of 128, 8 KV heads; squared-ReLU MLP 32768; vocabulary 131072), NOT from
measurements. Assumptions, all stated in ``ASSUMPTIONS`` and in the JSON:

* device: H100-class, 989 TFLOP/s bf16 dense, every FLOP at 40 % of that (395.6 TFLOP/s);
* micro-batch: 1 sequence of 4096 tokens; global batch 4096 sequences (16.8 M tokens) per step;
* F FLOPs = 2 x weights x tokens (+ causal attention core 2·s·d per token, Mamba scan
  2·d_inner·(2·N + 256) per token); W = the weight-gradient matmuls (= the linear part of F);
  I = the input-gradient matmuls + the attention core / scan backward (2x their forward) + a full
  recomputation of F (full activation checkpointing per layer, torchtitan's default for large
  models): a layer saves only its input (2·s·h bytes) from F to its W;
* bytes: bf16 parameters (2 B/param, what UNSHARD gathers and holds), bf16 gradients (2 B/param,
  reduce-scattered), fp32 master weights + Adam moments as optimizer state (12 B/param); sharded
  over dp by FSDP; boundary tensors 2·s·h bytes;
* interconnect: 8 GPUs per node on NVLink (450 GB/s per direction), InfiniBand NDR 400 Gb/s = 50 GB/s
  per GPU between nodes. The mesh is pipeline-outermost (global rank = p·dp + d): a data-parallel
  group of at most 8 ranks lies inside a node (NVLink ring, 450 GB/s, 2 us per hop; the profile's
  ``max_group_size = 8`` entry), larger ones span nodes (50 GB/s, 5 us per hop); at 1024-8192
  devices every dp is >= 16. Pipeline sends go between nodes: 50 GB/s, 5 us.

Not modelled: the recompute working set of one layer during its backward, allocator fragmentation,
tensor/context parallelism, per-layer (rather than per-stage) FSDP prefetching, the stash a
split backward (I before W) keeps for W under activation checkpointing.

    .venv/bin/python bench/tune_mesh.py [--runs 3] [--devices 1024 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate, GroupLinks, Link
from octopipe.tune import MeshTuneConfig, MeshTuneResult, tune_mesh

OUT = Path(__file__).parent / "results" / "tune_mesh.json"
NEMOTRONH_56B = (
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
    "M-M-M-M-M*-M-M-M-M-M-"
)
HIDDEN, SEQ, VOCAB = 8192, 4096, 131072
FFN = 32768
MAMBA_HEADS, MAMBA_HEAD_DIM, STATE, GROUPS, CONV, CHUNK = 256, 64, 256, 8, 4, 256
ATTN_HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128
PEAK_FLOPS, EFFICIENCY = 989e12, 0.40
GLOBAL_BATCH = 4096
CAP_BYTES = 80 * 10**9
MAX_PP = 64  # the most pipeline ranks 120 layers allow among the divisors of 1024, 4096 and 8192
IB = Link(latency_us=5.0, bandwidth_bytes_per_second=50e9)
NVLINK = Link(latency_us=2.0, bandwidth_bytes_per_second=450e9)
ASSUMPTIONS = {
    "model": "Nemotron-H 56B shape: hidden 8192, 118 layers (54 Mamba-2, 10 attention, 54 squared-ReLU MLP), "
    "vocab 131072, untied head",
    "device": "H100-class: 989 TFLOP/s bf16 dense at 40% (395.6 TFLOP/s effective), 80 GB (cap 80e9 bytes)",
    "microbatch": "1 sequence x 4096 tokens; global batch 4096 sequences (16.8M tokens)",
    "recompute": "full activation checkpointing per layer: I includes a recomputed F; a layer holds 2*s*h bytes",
    "precision": "bf16 params (2 B) and grads (2 B); fp32 master + Adam m, v (12 B) as optimizer state",
    "interconnect": "NVLink 450 GB/s per direction inside an 8-GPU node; InfiniBand NDR 400 Gb/s = 50 GB/s per "
    "GPU between nodes; dp groups of <= 8 ranks on NVLink (2 us per hop), larger ones (all here: dp >= 16) "
    "span nodes: ring at 50 GB/s, 5 us per hop; pipeline p2p 50 GB/s, 5 us",
    "collectives": "ring: all-gather / reduce-scatter (n-1)/n * bytes / bw + (n-1) * latency",
}


def _layer(name: str, kind: str, weights: int, extra_forward: float, extra_backward: float) -> profile_pb2.LayerCost:
    tokens = SEQ
    rate = PEAK_FLOPS * EFFICIENCY / 1e6  # FLOP per us
    linear = 2.0 * weights * tokens / rate
    forward = linear + extra_forward * tokens / rate
    boundary = 2 * SEQ * HIDDEN
    layer = profile_pb2.LayerCost(
        layer_name=name,
        layer_type=kind,
        forward_duration_us=forward,
        backward_input_duration_us=forward + linear + extra_backward * tokens / rate,
        backward_weight_duration_us=linear,
        activation_saved_bytes=boundary,
        activation_freed_by_backward_input_bytes=0,
        activation_freed_by_backward_weight_bytes=boundary,
        parameter_bytes=2 * weights,
        gradient_bytes=2 * weights,
        optimizer_state_bytes=12 * weights,
    )
    if kind != "head":
        layer.output_tensors.add(shape=[SEQ, HIDDEN], dtype="bfloat16", size_bytes=boundary)
    return layer


def nemotronh_56b_profile() -> profile_pb2.Profile:
    """The full-size nemotronh-56b as a Profile (analytic costs; see the module doc)."""
    d_inner = MAMBA_HEADS * MAMBA_HEAD_DIM
    mamba = HIDDEN * (2 * d_inner + 2 * GROUPS * STATE + MAMBA_HEADS) + (d_inner + 2 * GROUPS * STATE) * CONV
    mamba += d_inner * HIDDEN + 3 * MAMBA_HEADS + d_inner + HIDDEN
    attention = HIDDEN * (ATTN_HEADS + 2 * KV_HEADS) * HEAD_DIM + ATTN_HEADS * HEAD_DIM * HIDDEN + HIDDEN
    mlp = 2 * HIDDEN * FFN + HIDDEN
    scan = 2.0 * d_inner * (2 * STATE + CHUNK)  # FLOPs per token
    core = 2.0 * SEQ * ATTN_HEADS * HEAD_DIM  # causal QK^T and AV, FLOPs per token
    profile = profile_pb2.Profile(device="analytic H100-class (bench/tune_mesh.py)", microbatch_size=1)
    profile.model.name = "nemotronh-56b"
    profile.labels["costs"] = "analytic, full size; see bench/tune_mesh.py ASSUMPTIONS"
    profile.layers.append(_layer("embed", "embedding", VOCAB * HIDDEN, 0.0, 0.0))
    profile.layers[0].forward_duration_us = profile.layers[0].backward_input_duration_us = 100.0
    profile.layers[0].backward_weight_duration_us = 200.0  # a gather and a scatter-add, not matmuls
    for index, code in enumerate(NEMOTRONH_56B):
        name = f"layers.{index}"
        if code == "M":
            profile.layers.append(_layer(name, "mamba2", mamba, scan, 2 * scan))
        elif code == "*":
            profile.layers.append(_layer(name, "attention", attention, core, 2 * core))
        else:
            profile.layers.append(_layer(name, "relu2", mlp, 0.0, 0.0))
    profile.layers.append(_layer("head", "head", VOCAB * HIDDEN + HIDDEN, 0.0, 0.0))
    profile.collectives.extend(GroupLinks(data_parallel=IB, data_parallel_within={8: NVLINK}).to_proto())
    for source in range(MAX_PP):  # pipeline sends between pipeline ranks (every pair, as bench/tune_workloads.py)
        for destination in range(MAX_PP):
            if source != destination:
                profile.links.add(
                    source_rank=source,
                    destination_rank=destination,
                    latency_us=IB.latency_us,
                    bandwidth_bytes_per_second=IB.bandwidth_bytes_per_second,
                )
    return profile


def _estimate(estimate: Estimate, global_batch: int) -> dict[str, Any]:
    seconds = estimate.step_time_us / 1e6
    return {
        "step_time_s": seconds,
        "bubble_ratio": estimate.bubble_ratio,
        "samples_per_second": estimate.samples_per_second,
        "tokens_per_second": global_batch * SEQ / seconds,
        "peak_memory_gb_max_rank": max(r.peak_memory_bytes for r in estimate.ranks) / 1e9,
        "fits_80gb": estimate.fits,
        "communication_overlap_ratio": estimate.communication_overlap_ratio,
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _row(devices: int, result: MeshTuneResult, walls: list[float], cpus: list[float]) -> dict[str, Any]:
    return {
        "devices": devices,
        "tuner_wall_s": _spread(walls),
        "tuner_cpu_s": _spread(cpus),
        "simulations": result.simulations,
        "chosen": {
            "pp": result.pp,
            "dp": result.dp,
            "microbatches": result.num_microbatches,
            "microbatch_sequences": result.microbatch_size,
            "plan": result.plan.name,
            "description": result.description,
        },
        "tuned": _estimate(result.estimate, GLOBAL_BATCH),
        "baseline_1f1b_same_mesh": _estimate(result.baseline, GLOBAL_BATCH),
        "throughput_vs_1f1b": result.speedup,
        "candidates": [
            {
                "pp": c.pp,
                "dp": c.dp,
                "microbatches": c.num_microbatches,
                "step_time_s": c.step_time_us / 1e6,
                "fits": c.fits,
                "schedule": c.schedule,
                "peak_memory_gb": c.peak_memory_bytes / 1e9,
                "reason": c.reason,
            }
            for c in result.candidates
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--devices", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--refine", type=float, default=0.0, help="seconds of partition refinement (default 0)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    profile = nemotronh_56b_profile()
    rows = []
    header = (
        f"{'devices':>7} {'wall s (min-max)':>18} {'cpu s':>6} {'pp':>3} {'dp':>5} {'m':>4}  {'step s':>7} {'bubble':>7} "
        f"{'Mtok/s':>7} {'GB':>5} | {'1F1B s':>7} {'bubble':>7} {'GB':>5} {'fits':>5} | {'x 1F1B':>6}  schedule"
    )
    print(header)
    for devices in args.devices:
        config = MeshTuneConfig(
            devices=devices, global_batch=GLOBAL_BATCH, memory_cap_bytes=CAP_BYTES, refine_s=args.refine
        )
        walls, cpus = [], []
        result = None
        for _ in range(args.runs):
            wall, cpu = time.perf_counter(), time.process_time()
            result = tune_mesh(profile, config)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        assert result is not None
        row = _row(devices, result, walls, cpus)
        rows.append(row)
        t, b = row["tuned"], row["baseline_1f1b_same_mesh"]
        print(
            f"{devices:7d} {statistics.median(walls):7.2f} ({min(walls):.2f}-{max(walls):.2f}) "
            f"{statistics.median(cpus):6.2f} {result.pp:3d} "
            f"{result.dp:5d} {result.num_microbatches:4d}  {t['step_time_s']:7.2f} {t['bubble_ratio']:7.1%} "
            f"{t['tokens_per_second'] / 1e6:7.2f} {t['peak_memory_gb_max_rank']:5.1f} | {b['step_time_s']:7.2f} "
            f"{b['bubble_ratio']:7.1%} {b['peak_memory_gb_max_rank']:5.1f} {b['fits_80gb']!s:>5} | "
            f"{result.speedup:6.3f}  {result.description}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": "nemotronh-56b (full size, analytic costs)",
        "assumptions": ASSUMPTIONS,
        "memory_cap_bytes": CAP_BYTES,
        "global_batch_sequences": GLOBAL_BATCH,
        "bubble_ratio_convention": "idle compute time / step time, mean over pipeline ranks",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (one used), python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        "command": "python bench/tune_mesh.py --runs " + str(args.runs),
        "reproduce_one": "octopipe tune PROFILE.json --devices 8192 --global-batch 4096 --memory-cap 80GB "
        "(PROFILE.json: json_format.MessageToJson(nemotronh_56b_profile()))",
        "results": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
