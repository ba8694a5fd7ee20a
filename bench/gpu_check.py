"""The prepared GPU check: what octopipe does on one CUDA GPU, in one short run, into one JSON.

Run it on a machine with a GPU (no package index needed: it uses the checkout and its venv):

    python bench/gpu_check.py [--steps 6] [--out bench/results/gpu_check.json]

It records the machine (GPUs, torch, CUDA and NCCL versions), then:

(a) ``pytest tests/gpu``: plans with every stage on the one GPU (1F1B, ZB-H1, ZB-V; llama-8 and
    nemotronh-16, tiny) against eager CUDA with deterministic kernels: float32 and bf16 bitwise equal to
    eager in the same dtype, bf16 within the stated tolerances of float32;
(b) per workload, precision and plan: the profiler on the device (CUDA events per graph, the CUDA
    allocator), the simulator's prediction from that profile, and ``run_local(device=...)``'s measured
    step time (median after the first step, on the device's clock) and allocator peak (one extra step
    under ``max_memory_allocated``); the errors against the goals (step time 5%, peak memory 3%);
(c) the split overhead, (B+W) / fused backward per block (``bench/split_overhead.py``; bf16 on a GPU);
(d) the device's and the host's times of the same actions (CUDA events vs the host clock around the
    call that queued the work), per action kind.

Not exercised by it: NCCL between GPUs (one GPU: a plan on one rank exchanges no messages).
``--device cpu`` runs the same script on the CPU (part (a) is then skipped, as tests/gpu skips without a
GPU; bf16 runs there too): how CI checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from quiet import Environment, step_summary, write_record  # noqa: E402

from octopipe.execute.runs import RunOptions, RunResult  # noqa: E402
from octopipe.execute.runtime import build_model, run_local, workload_reference  # noqa: E402
from octopipe.execute.runtime.pipeline import compare, profile_reference  # noqa: E402
from octopipe.transform import visible_gpus  # noqa: E402
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v  # noqa: E402

SCHEDULES = {"1f1b": (one_f_one_b, 1), "zb-h1": (zb_h1, 1), "zb-v": (zb_v, 2)}
WORKLOADS = ("llama-8", "nemotronh-16")
PRECISIONS = ("float32", "bfloat16")
#: the issue's goals for a single-GPU plan: predicted vs measured
STEP_GOAL, MEMORY_GOAL, SPLIT_GOAL = 0.05, 0.03, 1.02


def _machine() -> dict[str, Any]:
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in visible_gpus()],
    }


def _gpu_tests(timeout_s: float) -> dict[str, Any]:
    """Part (a): the tests/gpu suite's outcome, test by test."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/gpu", "-p", "no:cacheprovider"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = done.stdout.strip().splitlines()
    return {
        "command": " ".join(command[1:]),
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "summary": lines[-1] if lines else "",
        "skipped": [line for line in lines if line.startswith("SKIPPED")],
        "failures": [line for line in lines if line.startswith("FAILED")],
    }


def _action_clocks(result: RunResult) -> dict[str, dict[str, float]]:
    """Part (d): per action kind, the median duration on the device's clock and on the host's."""
    kinds: dict[str, tuple[list[float], list[float]]] = {}
    for timeline in result.timelines.get(0, [])[1:]:  # the first step warms up
        for record in timeline.records:
            kind = record.action.lstrip("0123456789").split("(")[0].rstrip("0123456789") or record.action
            device, host = kinds.setdefault(kind, ([], []))
            device.append((record.end_ns - record.start_ns) / 1e3)
            host.append((record.host_end_ns - record.host_start_ns) / 1e3)
    return {
        kind: {"device_us": statistics.median(d), "host_us": statistics.median(h), "count": len(d)}
        for kind, (d, h) in sorted(kinds.items())
    }


def _plan_figures(
    workload: str, precision: str, schedule: str, args: argparse.Namespace, profile: Any
) -> dict[str, Any]:
    """Part (b) and (d): one plan on the one device, predicted and measured."""
    make, stages = SCHEDULES[schedule]
    reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * args.microbatches)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = make(1, args.microbatches, layer_names=equal_partition(names, stages))
    plan.model.CopyFrom(reference)
    if precision != "float32":
        plan.precision.compute_dtype = precision
    options = RunOptions(steps=args.steps, device=args.device, measure_memory=True, pin_cores=False)
    result = run_local(plan, options)
    got = compare(plan, profile, [result])
    timed = list(got.measured_steps_us[1:])
    return {
        "workload": workload,
        "precision": precision,
        "schedule": schedule,
        "plan": plan.name,
        "losses": result.losses,
        "step": step_summary(timed),
        "predicted_step_ms": got.predicted_step_us / 1e3,
        "replayed_step_ms": got.replay_step_us / 1e3,
        "step_time_error": got.step_time_error,
        "predicted_peak_bytes": got.predicted_memory_bytes[0],
        "allocator_peak_bytes": got.allocator_memory_bytes[0] if got.allocator_memory_bytes else None,
        "memory_error": got.memory_error,
        "memory": result.memory.get(0, {}),
        "actions": _action_clocks(result),
    }


def _split_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Part (c): bench/split_overhead.py on the device (bf16 on a GPU, the bench's float32 on the CPU)."""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "split.json"
        command = [sys.executable, str(ROOT / "bench/split_overhead.py"), "--device", args.device, "--dtype", dtype]
        command += ["--repeats", str(args.split_repeats), "--warmup", str(max(1, args.split_repeats // 5))]
        command += [
            "--sequence",
            str(args.split_sequence),
            "--blocks",
            *args.split_blocks.split(","),
            "--out",
            str(out),
        ]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            return {"command": " ".join(command[1:]), "error": done.stderr[-2000:]}
        record = json.loads(out.read_text())
    rows = {row["block"]: row["ours_ratio"]["median"] for row in record["rows"]}
    return {
        "dtype": dtype,
        "rows": record["rows"],
        "meta": record["meta"],
        "within_goal": {block: ratio <= SPLIT_GOAL for block, ratio in rows.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script itself")
    parser.add_argument("--steps", type=int, default=6, help="steps per plan; the first is warm-up (default 6)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default all)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated (default all)")
    parser.add_argument("--profile-repeats", type=int, default=10, help="timed runs per profiled graph (default 10)")
    parser.add_argument("--split-repeats", type=int, default=30, help="split-overhead repeats (default 30)")
    parser.add_argument("--split-sequence", type=int, default=128, help="split-overhead tokens (default 128)")
    parser.add_argument("--split-blocks", default="llama,moe,mamba", help="split-overhead blocks (default all)")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for tests/gpu (default 300)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first warms up)")
    if args.device == "cuda" and not visible_gpus():
        print("gpu_check: torch sees no GPU here (use --device cpu to check the script itself)", file=sys.stderr)
        return 2
    environment = Environment()
    record: dict[str, Any] = {
        "device": args.device,
        "machine": _machine(),
        "goals": {"step_time_error": STEP_GOAL, "memory_error": MEMORY_GOAL, "split_ratio": SPLIT_GOAL},
        "not_checked": ["NCCL between GPUs: one GPU here, so a plan on it exchanges no messages"],
    }
    record["tests"] = _gpu_tests(args.tests_timeout) if args.device == "cuda" else {"skipped": "device cpu"}
    plans = []
    header = f"{'workload':<13} {'dtype':<8} {'plan':<6} {'step ms':>8} {'predicted':>9} {'err':>6}"
    print(f"{header} {'peak MiB':>9} {'predicted':>9} {'err':>6}")
    for workload in args.workloads.split(","):
        for precision in args.precisions.split(","):
            reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * args.microbatches)
            profile = profile_reference(
                reference,
                num_microbatches=args.microbatches,
                num_ranks=1,
                repeats=args.profile_repeats,
                precision="" if precision == "float32" else precision,
                device=args.device,
            )
            for schedule in args.schedules.split(","):
                row = _plan_figures(workload, precision, schedule, args, profile)
                plans.append(row)
                peak = (row["allocator_peak_bytes"] or 0) / 2**20
                print(
                    f"{workload:<13} {precision[:8]:<8} {schedule:<6} {row['step']['median_ms']:>8.2f} "
                    f"{row['predicted_step_ms']:>9.2f} {row['step_time_error']:>6.1%} {peak:>9.1f} "
                    f"{row['predicted_peak_bytes'] / 2**20:>9.1f} {row['memory_error'] or 0:>6.1%}"
                )
    record["plans"] = plans
    # same model, data and micro-batches: every schedule's first loss (before any update) is the same
    losses_agree = all(
        p["losses"][0] == q["losses"][0]
        for p in plans
        for q in plans
        if (p["workload"], p["precision"]) == (q["workload"], q["precision"])
    )
    record["every_schedule_same_first_loss"] = losses_agree
    record["within_goals"] = {
        "step_time": all(p["step_time_error"] <= STEP_GOAL for p in plans),
        "memory": all((p["memory_error"] or 0) <= MEMORY_GOAL for p in plans),
    }
    record["split_overhead"] = _split_overhead(args)
    for row in record["split_overhead"].get("rows", []):
        print(f"split overhead {row['block']:<6} (B+W)/fused {row['ours_ratio']['median']:.3f}")
    if record["tests"].get("summary"):
        print(f"tests/gpu: {record['tests']['summary']}")
    record["environment"] = environment.finish()
    write_record(args.out, record)
    failed = record["tests"].get("exit_code", 0) not in (0, None) or not losses_agree
    return 1 if failed or "error" in record["split_overhead"] else 0


if __name__ == "__main__":
    sys.exit(main())
