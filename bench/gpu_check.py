"""The prepared GPU check: what octopipe does on one CUDA GPU, in one short run, into one JSON.

Run it on a machine with a GPU (no package index needed: it uses the checkout and its venv):

    python bench/gpu_check.py [--steps 6] [--out bench/results/gpu_check.json]

It records the machine (GPUs, torch and CUDA versions), then:

(a) ``pytest tests/gpu``: plans with every stage on the one GPU (1F1B, ZB-H1, ZB-V; llama-8 and
    nemotronh-16, tiny) against eager CUDA, fp32, bitwise, with deterministic kernels;
(b) per plan, ``run_local(device="cuda")``: the measured step time (median after the first step,
    host clock around each step) and the step's allocator peak (``max_memory_allocated`` above the
    resident weights and optimizer state, one extra step under the meter).

Not yet in it (named so that no one reads their absence as a pass): predicted vs measured on the GPU
(the profiler does not time layers on CUDA yet), bf16 (no mixed-precision policy yet), the split
overhead in bf16, CUDA-event timings. ``--device cpu`` runs the same script on the CPU (part (a) is
then skipped, as tests/gpu skips without a GPU): how CI checks the script itself.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from quiet import Environment, step_summary, write_record  # noqa: E402

from octopipe.execute.runs import RunOptions  # noqa: E402
from octopipe.execute.runtime import build_model, measured_step_times_us, run_local, workload_reference  # noqa: E402
from octopipe.transform import visible_gpus  # noqa: E402
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v  # noqa: E402

SCHEDULES = {"1f1b": (one_f_one_b, 1), "zb-h1": (zb_h1, 1), "zb-v": (zb_v, 2)}
WORKLOADS = ("llama-8", "nemotronh-16")


def _machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
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


def _plan_figures(workload: str, schedule: str, device: str, steps: int, microbatches: int) -> dict[str, Any]:
    """Part (b): one plan on the one device: step times and the allocator's peak."""
    make, stages = SCHEDULES[schedule]
    reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * microbatches)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = make(1, microbatches, layer_names=equal_partition(names, stages))
    plan.model.CopyFrom(reference)
    result = run_local(plan, RunOptions(steps=steps, device=device, measure_memory=True, pin_cores=False))
    times = measured_step_times_us(result)[1:]  # the first step warms up
    memory = result.memory.get(0, {})
    return {
        "workload": workload,
        "schedule": schedule,
        "plan": plan.name,
        "losses": result.losses,
        "step": step_summary(times),
        "memory": memory,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script itself")
    parser.add_argument("--steps", type=int, default=6, help="steps per plan; the first is warm-up (default 6)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default all)")
    parser.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for tests/gpu (default 300)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first warms up)")
    if args.device == "cuda" and not visible_gpus():
        print("gpu_check: torch sees no GPU here (use --device cpu to check the script itself)", file=sys.stderr)
        return 2
    environment = Environment()
    record: dict[str, Any] = {"device": args.device, "machine": _machine(), "not_checked_yet": [
        "predicted vs measured step time and memory on the GPU (no CUDA layer profiling yet)",
        "bf16 (no mixed-precision policy yet) and the bf16 split overhead",
        "CUDA-event timings vs host clocks",
        "NCCL between GPUs (one GPU here; GPU ranks exchange no messages yet)",
    ]}  # fmt: skip
    record["tests"] = _gpu_tests(args.tests_timeout) if args.device == "cuda" else {"skipped": "device cpu"}
    plans = []
    print(f"{'workload':<14} {'schedule':<7} {'step ms (median)':>17} {'p10-p90':>15} {'peak MiB':>9}")
    for workload in args.workloads.split(","):
        for schedule in args.schedules.split(","):
            figures = _plan_figures(workload, schedule, args.device, args.steps, args.microbatches)
            plans.append(figures)
            step, peak = figures["step"], figures["memory"].get("peak_bytes", 0) / 2**20
            print(
                f"{workload:<14} {schedule:<7} {step['median_ms']:>17.2f} "
                f"{step['p10_ms']:>7.2f}-{step['p90_ms']:<7.2f} {peak:>9.1f}"
            )
    record["plans"] = plans
    # same model, data and micro-batches: every schedule's first loss (before any update) is the same
    losses_agree = all(p["losses"][0] == q["losses"][0] for p in plans for q in plans if p["workload"] == q["workload"])
    record["every_schedule_same_first_loss"] = losses_agree
    if "tests" in record and record["tests"].get("summary"):
        print(f"tests/gpu: {record['tests']['summary']}")
    record["environment"] = environment.finish()
    write_record(args.out, record)
    failed = record["tests"].get("exit_code", 0) not in (0, None) or not losses_agree
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
