"""Mesh tuner (pp x dp x tp x cp x m with FSDP collectives) for nemotronh-56b (and llama-32-wide) on 1024,
4096 and 8192 devices, against the pp x dp-only search.

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

Tensor and context parallelism (issue 24; octopipe.simulate.tensor_parallel): tp over the divisors of
the device count up to 8 (one node) that divide the heads, Mamba heads and FFN; cp over the divisors of
the sequence up to 32, never with Mamba layers (nemotronh-56b: cp = 1). Per layer the profile gives the
runtime's all-reduce volumes: Mamba-2 two all-reduces per pass ([s, h] out_proj and [s, dt_rank + 2 N]
x_proj, dt_rank = h/16 as the zoo's Mamba), attention and MLP one [s, h]; attention's CP all-gather of
K and V ([s, 2 x 8 KV heads x 128]); every layer recomputes its forward in the backward (full
checkpointing), so the backward repeats the forward's collectives. The tp group (8 consecutive ranks) is
on NVLink; the cp and dp groups span cp x tp and dp x cp x tp ranks (NVLink only within 8). The
embedding and the head are replicated on the tp ranks, as the runtime runs them.

``llama-32-wide`` (only with ``--models llama-32-wide``, default on): 32 Llama layers of Llama-3-70B width
(hidden 8192, 64 heads, 8 KV heads, SwiGLU 28672, vocabulary 128256), attention only, at a long
context: 32768 tokens per sequence, global batch 512 sequences (16.8 M tokens, as nemotronh-56b), so cp
is searched. Same device, precision, checkpointing and links. Not in shared/benchmarks.md at this width:
its ``llama-32`` is hidden 256; this one exists to exercise cp.

Not modelled: the recompute working set of one layer during its backward, allocator fragmentation,
per-layer (rather than per-stage) FSDP prefetching, the stash a split backward (I before W) keeps for W
under activation checkpointing, causal load imbalance between cp ranks, sequence parallelism.

    .venv/bin/python bench/tune_mesh.py [--runs 1] [--devices 1024 4096 8192] [--models nemotronh-56b llama-32-wide]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
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
DT_RANK = HIDDEN // 16  # the zoo's Mamba: x_proj outputs dt_rank + 2 * d_state per token
NEMOTRON_FACTS = {"heads": ATTN_HEADS, "mamba_heads": MAMBA_HEADS, "ffn": FFN, "sequence": SEQ, "mamba_layers": 54}
LLAMA_SEQ, LLAMA_FFN, LLAMA_VOCAB, LLAMA_LAYERS, LLAMA_BATCH = 32768, 28672, 128256, 32, 512
LLAMA_FACTS = {"heads": ATTN_HEADS, "ffn": LLAMA_FFN, "sequence": LLAMA_SEQ}
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
    "tensor_parallel": "Megatron TP: per Mamba-2 layer all-reduces of [s, h] and [s, h/16 + 2*256] per pass, per "
    "attention and MLP one [s, h]; embedding and head replicated on tp ranks; tp group = 8 consecutive ranks on NVLink",
    "context_parallel": "all-gather of K, V ([s, 2*8*128]) per attention layer, reduce-scatter of their gradients, "
    "gradient all-reduce over cp per step; never with Mamba layers",
    "recompute_collectives": "every layer's backward recomputes its forward, with its TP/CP collectives",
}


def _layer(
    name: str, kind: str, weights: int, extra_forward: float, extra_backward: float, seq: int = SEQ
) -> profile_pb2.LayerCost:
    tokens = seq
    rate = PEAK_FLOPS * EFFICIENCY / 1e6  # FLOP per us
    linear = 2.0 * weights * tokens / rate
    forward = linear + extra_forward * tokens / rate
    boundary = 2 * seq * HIDDEN
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
        backward_recomputes_forward=kind not in ("embedding", "head"),  # full activation checkpointing
    )
    if kind != "head":
        layer.output_tensors.add(shape=[seq, HIDDEN], dtype="bfloat16", size_bytes=boundary)
    if kind == "mamba2":  # out_proj's [s, h] and x_proj's [s, dt_rank + 2 N] all-reduces
        layer.tensor_parallel_all_reduce_bytes = 2 * seq * (HIDDEN + DT_RANK + 2 * STATE)
        layer.tensor_parallel_all_reduces = 2
    if "attention" in kind:  # keys and values of the whole sequence, 8 KV heads
        layer.context_parallel_gather_bytes = 2 * seq * 2 * KV_HEADS * HEAD_DIM
    return layer


def _links(profile: profile_pb2.Profile) -> None:
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


def llama_32_wide_profile() -> profile_pb2.Profile:
    """32 Llama layers at Llama-3-70B width, 32768-token sequences (analytic costs; see the module doc)."""
    attention = HIDDEN * (ATTN_HEADS + 2 * KV_HEADS) * HEAD_DIM + ATTN_HEADS * HEAD_DIM * HIDDEN
    mlp = 3 * HIDDEN * LLAMA_FFN
    core = 2.0 * LLAMA_SEQ * ATTN_HEADS * HEAD_DIM
    profile = profile_pb2.Profile(device="analytic H100-class (bench/tune_mesh.py)", microbatch_size=1)
    profile.model.name = "llama-32-wide"
    profile.labels["costs"] = "analytic, Llama-3-70B layer width, 32 layers, 32768 tokens; see bench/tune_mesh.py"
    profile.layers.append(_layer("embed", "embedding", LLAMA_VOCAB * HIDDEN, 0.0, 0.0, LLAMA_SEQ))
    profile.layers[0].forward_duration_us = profile.layers[0].backward_input_duration_us = 800.0
    profile.layers[0].backward_weight_duration_us = 1600.0
    for index in range(LLAMA_LAYERS):
        weights = attention + mlp + 2 * HIDDEN
        profile.layers.append(_layer(f"layers.{index}", "attention+swiglu", weights, core, 2 * core, LLAMA_SEQ))
    profile.layers.append(_layer("head", "head", LLAMA_VOCAB * HIDDEN + HIDDEN, 0.0, 0.0, LLAMA_SEQ))
    _links(profile)
    return profile


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
    _links(profile)
    return profile


def _estimate(estimate: Estimate, tokens: int) -> dict[str, Any]:
    seconds = estimate.step_time_us / 1e6
    return {
        "step_time_s": seconds,
        "bubble_ratio": estimate.bubble_ratio,
        "samples_per_second": estimate.samples_per_second,
        "tokens_per_second": tokens / seconds,
        "peak_memory_gb_max_rank": max(r.peak_memory_bytes for r in estimate.ranks) / 1e9,
        "fits_80gb": estimate.fits,
        "communication_overlap_ratio": estimate.communication_overlap_ratio,
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _choice(result: MeshTuneResult, tokens: int, walls: list[float], cpus: list[float]) -> dict[str, Any]:
    return {
        "tuner_wall_s": _spread(walls),
        "tuner_cpu_s": _spread(cpus),
        "simulations": result.simulations,
        "chosen": {
            "pp": result.pp,
            "dp": result.dp,
            "tp": result.tp,
            "cp": result.cp,
            "sequence_parallel": result.plan.mesh.sequence_parallel,
            "ep": result.ep,
            "microbatches": result.num_microbatches,
            "microbatch_sequences": result.microbatch_size,
            "plan": result.plan.name,
            "description": result.description,
        },
        "tuned": _estimate(result.estimate, tokens),
        "baseline_1f1b_same_mesh": _estimate(result.baseline, tokens),
        "throughput_vs_1f1b": result.speedup,
        "candidates": [
            {
                "pp": c.pp,
                "dp": c.dp,
                "tp": c.tp,
                "cp": c.cp,
                "ep": c.ep,
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


def _timed(
    profile: profile_pb2.Profile, config: MeshTuneConfig, runs: int
) -> tuple[MeshTuneResult, list[float], list[float]]:
    walls, cpus = [], []
    result = None
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = tune_mesh(profile, config)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    assert result is not None
    return result, walls, cpus


def _line(model: str, devices: int, search: str, result: MeshTuneResult, tokens: int, cpus: list[float]) -> str:
    t = _estimate(result.estimate, tokens)
    return (
        f"{model:>14} {devices:7d} {search:>9} {statistics.median(cpus):6.2f} {result.pp:3d} {result.dp:5d} "
        f"{result.tp:3d} {result.cp:3d} {result.ep:3d} {result.num_microbatches:4d}  {t['step_time_s']:7.2f} "
        f"{t['bubble_ratio']:7.1%} {t['tokens_per_second'] / 1e6:7.2f} {t['peak_memory_gb_max_rank']:5.1f}  "
        f"{result.description}"
    )


MODELS = {
    "nemotronh-56b": (nemotronh_56b_profile, NEMOTRON_FACTS, GLOBAL_BATCH, SEQ),
    "llama-32-wide": (llama_32_wide_profile, LLAMA_FACTS, LLAMA_BATCH, LLAMA_SEQ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--devices", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--refine", type=float, default=0.0, help="seconds of partition refinement (default 0)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    load_before = os.getloadavg()
    print(
        f"{'model':>14} {'devices':>7} {'search':>9} {'cpu s':>6} {'pp':>3} {'dp':>5} {'tp':>3} {'cp':>3} {'ep':>3} "
        f"{'m':>4}  {'step s':>7} {'bubble':>7} {'Mtok/s':>7} {'GB':>5}  schedule"
    )
    rows = []
    for model in args.models:
        build, facts, batch, seq = MODELS[model]
        profile = build()
        tokens = batch * seq
        for devices in args.devices:
            config = MeshTuneConfig(
                devices=devices,
                global_batch=batch,
                memory_cap_bytes=CAP_BYTES,
                refine_s=args.refine,
                model_facts=facts,
            )
            plain, plain_walls, plain_cpus = _timed(profile, replace(config, tensor_parallel=False), args.runs)
            print(_line(model, devices, "pp x dp", plain, tokens, plain_cpus), flush=True)
            tuned, walls, cpus = _timed(profile, config, args.runs)
            print(_line(model, devices, "+ tp, cp", tuned, tokens, cpus), flush=True)
            gain = plain.estimate.step_time_us / tuned.estimate.step_time_us
            print(f"{'':>14} {'':>7} {'':>9} throughput x pp x dp-only: {gain:.3f}", flush=True)
            sp, sp_walls, sp_cpus = _timed(profile, replace(config, sequence_parallel=True), args.runs)
            print(_line(model, devices, "+ sp", sp, tokens, sp_cpus), flush=True)
            sp_gain = plain.estimate.step_time_us / sp.estimate.step_time_us
            print(f"{'':>14} {'':>7} {'':>9} throughput x pp x dp-only: {sp_gain:.3f}", flush=True)
            rows.append(
                {
                    "model": model,
                    "devices": devices,
                    "pp_dp_only": _choice(plain, tokens, plain_walls, plain_cpus),
                    "with_tp_cp": _choice(tuned, tokens, walls, cpus),
                    "throughput_vs_pp_dp_only": gain,
                    "with_tp_cp_sequence_parallel": _choice(sp, tokens, sp_walls, sp_cpus),
                    "throughput_sequence_parallel_vs_pp_dp_only": sp_gain,
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "workloads": {
            "nemotronh-56b": "full size, analytic costs, global batch 4096 x 4096 tokens",
            "llama-32-wide": "32 Llama layers at Llama-3-70B width, analytic costs, global batch 512 x 32768 tokens",
        },
        "assumptions": ASSUMPTIONS,
        "memory_cap_bytes": CAP_BYTES,
        "bubble_ratio_convention": "idle compute time / step time, mean over pipeline ranks",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (one used), python {platform.python_version()}",
        "load_average_before": load_before,
        "load_average_at_end": os.getloadavg(),
        "command": f"python bench/tune_mesh.py --runs {args.runs} --models {' '.join(args.models)}",
        "results": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
