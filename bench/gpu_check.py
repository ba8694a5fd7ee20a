"""The prepared GPU check: what octopipe does on one CUDA GPU, in one short run, into one JSON.

Run it on a machine with a GPU, from the repository root, with the octopipe packages importable (the
checkout's venv, or the wheels ``bench/gpu_check.sh`` installs where there is no package index):

    python bench/gpu_check.py [--steps 5] [--out bench/results/gpu_check.json] [--logs DIR]

It records the machine (GPUs, torch, CUDA and NCCL versions), then runs three parts, each in its own
process group with its own time limit (``--tests-timeout``, ``--plans-timeout``, ``--split-timeout``; all
within ``--budget``, 450 s by default, so that a cold H200 finishes in under 8.5 minutes; on 2026-12-04 tests/gpu needed more than 140 s and the plans 145 s there):

(a) ``pytest tests/gpu``: plans with every stage on the one GPU (1F1B, ZB-H1, ZB-V; llama-8 and
    nemotronh-16, tiny) against eager CUDA with deterministic kernels: float32 and bf16 bitwise equal to
    eager in the same dtype, bf16 within the stated tolerances of float32 (``--test-timeout`` per test where
    pytest-timeout is installed);
(b) per workload, precision and plan: the profiler on the device (CUDA events per graph, the CUDA
    allocator), the simulator's prediction from that profile, and ``run_local_many(device=...)``'s measured
    step time (median after the first step, on the device's clock) and allocator peak (one extra step
    under ``max_memory_allocated``); the errors against the goals (step time 5%, peak memory 3%). The three
    plans of one workload and precision run in one launch (each from the same fresh weights);
(c) the split overhead, (B+W) / fused backward per block (``bench/split_overhead.py``; bf16 on a GPU);
(d) the device's and the host's times of the same actions (CUDA events vs the host clock around the
    call that queued the work), per action kind (from (b)'s runs).

``--out`` is rewritten after every part (and after every workload x precision of (b)), so a run cut short
leaves what it measured; ``status`` says ``running`` until the end, ``parts`` says how each part ended
(``ok``, ``failed``, ``timeout`` with the limit, ``skipped``). ``--logs DIR`` keeps each part's output
(``gpu_check_tests.log``, ``gpu_check_plans.log``, ``gpu_check_split.log``); a failed part's JSON entry
carries its output's tail either way.

Exit status: 0 every part ran and every goal held; 1 a goal failed (every part ran); 2 no GPU (or bad
arguments); 3 a part crashed, timed out or was not reached (whatever the goals). The goals that decide it,
listed by name under ``goals_failed``:

- ``tests``: every test of tests/gpu passed (on a GPU);
- ``same_first_loss``: every schedule's first loss (before any update) is the same per workload and precision;
- ``step_time``: every plan's predicted step within 5% of the measured median (on a GPU);
- ``memory``: every plan's predicted peak within 3% of the allocator's (on a GPU);
- ``split_ratio``: every block's (B+W) / fused backward at most 1.02 (on a GPU).

Not exercised by it: NCCL between GPUs (one GPU: a plan on one rank exchanges no messages).
``--device cpu`` runs the same script on the CPU (part (a) is then skipped, as tests/gpu skips without a
GPU; bf16 runs there too; the timing and memory goals are the GPU's, recorded but not enforced): how CI
checks the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from quiet import Environment, step_summary  # noqa: E402

from octopipe.execute.runs import RunOptions, RunResult  # noqa: E402
from octopipe.execute.runtime import build_model, run_local_many, workload_reference  # noqa: E402
from octopipe.execute.runtime.pipeline import compare, profile_reference  # noqa: E402
from octopipe.transform import visible_gpus  # noqa: E402
from octopipe.tune import equal_partition, one_f_one_b, zb_h1, zb_v  # noqa: E402

SCHEDULES = {"1f1b": (one_f_one_b, 1), "zb-h1": (zb_h1, 1), "zb-v": (zb_v, 2)}
WORKLOADS = ("llama-8", "nemotronh-16")
PRECISIONS = ("float32", "bfloat16")
#: the issue's goals for a single-GPU plan: predicted vs measured
STEP_GOAL, MEMORY_GOAL, SPLIT_GOAL = 0.05, 0.03, 1.02
#: exit statuses (see the module's docstring)
EXIT_OK, EXIT_GOAL, EXIT_NO_GPU, EXIT_PART = 0, 1, 2, 3
#: how much of a failed part's output its JSON entry keeps
TAIL_CHARS = 3000


class Interrupted(Exception):
    """SIGTERM (``timeout`` around the script): the running part's process group is ended, the JSON written."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    del frame
    raise Interrupted(f"signal {signum}")


def _save(path: Path, record: dict[str, Any]) -> None:
    """Write the JSON whole or not at all (a reader never sees half a file, even if this process is killed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-TAIL_CHARS:] if log.exists() else ""


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """End a part's whole process group (the part, its rank processes, compile workers): TERM, then KILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)
        time.sleep(0.2)  # what the leader started may still be exiting
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _bounded(command: list[str], timeout_s: float, log: Path) -> int:
    """Run ``command`` from the repository root in its own process group, output to ``log``; its exit code.

    Raises subprocess.TimeoutExpired after ``timeout_s`` (or Interrupted on SIGTERM), the group ended first.
    """
    print(f"[gpu_check] {' '.join(command[1:])} (limit {timeout_s:.0f} s, log {log.name})", flush=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except BaseException:  # TimeoutExpired, Interrupted, KeyboardInterrupt
            _end_group(process)
            raise
        _end_group(process)  # a part that exited may leave rank processes behind: none outlive it
    return code


def _machine() -> dict[str, Any]:
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in visible_gpus()],
        "python": sys.version.split()[0],
    }


def _gpu_tests(args: argparse.Namespace, timeout_s: float, log: Path) -> dict[str, Any]:
    """Part (a): the tests/gpu suite's outcome, test by test (TimeoutExpired after ``timeout_s``)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/gpu", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test fails alone, the rest still run
        command += ["--timeout", str(args.test_timeout)]
    started = time.monotonic()
    code = _bounded(command, timeout_s, log)
    lines = log.read_text(errors="replace").strip().splitlines()
    return {
        "command": " ".join(command[1:]),
        "exit_code": code,
        "seconds": round(time.monotonic() - started, 1),
        "summary": lines[-1] if lines else "",
        "skipped": [line for line in lines if line.startswith("SKIPPED")],
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
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


def _plan_rows(workload: str, precision: str, args: argparse.Namespace, profile: Any) -> list[dict[str, Any]]:
    """Part (b) and (d): the plans of one workload and precision on the one device, predicted and measured."""
    reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * args.microbatches)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    schedules = args.schedules.split(",")
    plans = []
    for schedule in schedules:
        make, stages = SCHEDULES[schedule]
        plan = make(1, args.microbatches, layer_names=equal_partition(names, stages))
        plan.model.CopyFrom(reference)
        if precision != "float32":
            plan.precision.compute_dtype = precision
        plans.append(plan)
    options = RunOptions(steps=args.steps, device=args.device, measure_memory=True, pin_cores=False)
    rows = []
    for schedule, plan, result in zip(schedules, plans, run_local_many(plans, options), strict=True):
        got = compare(plan, profile, [result])
        timed = list(got.measured_steps_us[1:])
        rows.append(
            {
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
        )
    return rows


def _plans_part(args: argparse.Namespace) -> int:
    """Part (b) and (d), run as its own process (``--part plans``): rows added to ``--out`` as they come."""
    record: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    record["plans"], record["plan_errors"] = rows, errors
    for workload in args.workloads.split(","):
        for precision in args.precisions.split(","):
            started = time.monotonic()
            try:
                reference = workload_reference(workload, tiny=True, sequence=16, global_batch=2 * args.microbatches)
                profile = profile_reference(
                    reference,
                    num_microbatches=args.microbatches,
                    num_ranks=1,
                    repeats=args.profile_repeats,
                    precision="" if precision == "float32" else precision,
                    device=args.device,
                )
                rows.extend(_plan_rows(workload, precision, args, profile))
            except Exception as error:  # the other workloads and precisions still run
                traceback.print_exc()
                errors.append(
                    {"workload": workload, "precision": precision, "error": f"{type(error).__name__}: {error}"}
                )
            print(f"[plans] {workload} {precision}: {time.monotonic() - started:.1f} s", flush=True)
            _save(args.out, record)
    return 1 if errors else 0


def _split_overhead(args: argparse.Namespace, timeout_s: float, log: Path) -> dict[str, Any]:
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
        code = _bounded(command, timeout_s, log)
        if code != 0 or not out.exists():
            return {"command": " ".join(command[1:]), "error": f"exit code {code}: {_tail(log)}"}
        record = json.loads(out.read_text())
    rows = {row["block"]: row["ours_ratio"]["median"] for row in record["rows"]}
    return {
        "dtype": dtype,
        "rows": record["rows"],
        "meta": record["meta"],
        "within_goal": {block: ratio <= SPLIT_GOAL for block, ratio in rows.items()},
    }


def _print_plans(plans: list[dict[str, Any]]) -> None:
    header = f"{'workload':<13} {'dtype':<8} {'plan':<6} {'step ms':>8} {'predicted':>9} {'err':>6}"
    print(f"{header} {'peak MiB':>9} {'predicted':>9} {'err':>6}")
    for row in plans:
        peak = (row["allocator_peak_bytes"] or 0) / 2**20
        print(
            f"{row['workload']:<13} {row['precision'][:8]:<8} {row['schedule']:<6} {row['step']['median_ms']:>8.2f} "
            f"{row['predicted_step_ms']:>9.2f} {row['step_time_error']:>6.1%} {peak:>9.1f} "
            f"{row['predicted_peak_bytes'] / 2**20:>9.1f} {row['memory_error'] or 0:>6.1%}"
        )


class Parts:
    """Runs the parts one after another, each within its own limit and what is left of the budget."""

    def __init__(self, args: argparse.Namespace, record: dict[str, Any], logs: Path) -> None:
        self.args, self.record, self.logs = args, record, logs
        self.deadline = time.monotonic() + args.budget
        record["parts"] = {}

    def limit(self, own_s: float) -> float:
        return min(own_s, self.deadline - time.monotonic())

    def run(self, name: str, own_s: float, body: Callable[[float, Path], Any]) -> Any:
        """``body(timeout_s, log)``; its outcome under ``parts[name]``; the JSON written after it."""
        log = self.logs / f"gpu_check_{name}.log"
        timeout_s = self.limit(own_s)
        entry: dict[str, Any] = {"limit_s": round(timeout_s, 1)}
        self.record["parts"][name] = entry
        started = time.monotonic()
        result = None
        if timeout_s < 5:
            entry.update(status="skipped", error=f"the budget ({self.args.budget:.0f} s) was spent before it")
        else:
            entry["status"] = "running"
            _save(self.args.out, self.record)
            try:
                result = body(timeout_s, log)
                entry["status"] = "ok"
            except subprocess.TimeoutExpired as timeout:
                entry.update(status="timeout", error=f"timed out after {timeout.timeout:.0f} s", tail=_tail(log))
            except Interrupted as stop:
                entry.update(status="failed", error=f"interrupted ({stop}) after {time.monotonic() - started:.0f} s")
                entry["tail"] = _tail(log)
                raise
            except Exception as error:
                traceback.print_exc()
                entry.update(status="failed", error=f"{type(error).__name__}: {error}", tail=_tail(log))
            finally:
                entry["seconds"] = round(time.monotonic() - started, 1)
                _save(self.args.out, self.record)
        print(f"[gpu_check] part {name}: {entry['status']} ({entry.get('seconds', 0)} s)", flush=True)
        return result


def _goals(record: dict[str, Any], device: str) -> list[str]:
    """The names of the goals that failed (see the module's docstring); the GPU-only ones only on a GPU."""
    failed = []
    tests = record["tests"]
    if "exit_code" in tests and tests["exit_code"] == 1:  # 1: tests ran and some failed; others: the part failed
        failed.append("tests")
    if not record["every_schedule_same_first_loss"]:
        failed.append("same_first_loss")
    if device == "cuda":
        within = record["within_goals"]
        failed += [name for name in ("step_time", "memory") if not within[name]]
        if not all(record.get("split_overhead", {}).get("within_goal", {}).values()):
            failed.append("split_ratio")
    return failed


def _check(args: argparse.Namespace) -> int:
    environment = Environment()
    record: dict[str, Any] = {
        "status": "running",
        "device": args.device,
        "machine": _machine(),
        "goals": {"step_time_error": STEP_GOAL, "memory_error": MEMORY_GOAL, "split_ratio": SPLIT_GOAL},
        "goals_enforced": ["tests", "same_first_loss", "step_time", "memory", "split_ratio"]
        if args.device == "cuda"
        else ["same_first_loss"],
        "not_checked": ["NCCL between GPUs: one GPU here, so a plan on it exchanges no messages"],
    }
    keep = tempfile.TemporaryDirectory(prefix="gpu_check-") if args.logs is None else None
    logs = Path(keep.name) if keep is not None else args.logs
    logs.mkdir(parents=True, exist_ok=True)
    parts = Parts(args, record, logs)
    record["tests"] = {"skipped": "device cpu"}
    try:
        if args.device == "cuda":
            tests = parts.run("tests", args.tests_timeout, lambda t, log: _gpu_tests(args, t, log))
            record["tests"] = tests if tests is not None else {"error": record["parts"]["tests"].get("error", "")}
            if tests is not None and tests["exit_code"] not in (0, 1):  # 1: failures; 2-5: pytest itself failed
                record["parts"]["tests"].update(status="failed", error=f"pytest exit code {tests['exit_code']}")
        plans_command = [sys.executable, str(Path(__file__).resolve()), "--part", "plans", "--device", args.device]
        plans_command += ["--steps", str(args.steps), "--microbatches", str(args.microbatches)]
        plans_command += ["--workloads", args.workloads, "--schedules", args.schedules]
        plans_command += ["--precisions", args.precisions, "--profile-repeats", str(args.profile_repeats)]
        plans_command += ["--out", str(args.out)]

        def plans_body(timeout_s: float, log: Path) -> int:
            _save(args.out, record)  # the child adds its rows to this file as it goes
            try:
                return _bounded(plans_command, timeout_s, log)
            finally:  # whatever it got through, even if it timed out
                written = json.loads(args.out.read_text())
                record["plans"] = written.get("plans", [])
                record["plan_errors"] = written.get("plan_errors", [])

        record["plans"], record["plan_errors"] = [], []
        code = parts.run("plans", args.plans_timeout, plans_body)
        if code not in (0, None):
            errors = "; ".join(e["error"].splitlines()[0] for e in record["plan_errors"])
            record["parts"]["plans"].update(status="failed", error=f"exit code {code}: {errors}")
            record["parts"]["plans"]["tail"] = _tail(logs / "gpu_check_plans.log")
        plans = record["plans"]
        _print_plans(plans)
        # same model, data and micro-batches: every schedule's first loss (before any update) is the same
        record["every_schedule_same_first_loss"] = all(
            p["losses"][0] == q["losses"][0]
            for p in plans
            for q in plans
            if (p["workload"], p["precision"]) == (q["workload"], q["precision"])
        )
        record["within_goals"] = {
            "step_time": all(p["step_time_error"] <= STEP_GOAL for p in plans),
            "memory": all(p["memory_error"] is not None and p["memory_error"] <= MEMORY_GOAL for p in plans),
        }
        split = parts.run("split", args.split_timeout, lambda t, log: _split_overhead(args, t, log))
        record["split_overhead"] = split if split is not None else {"error": record["parts"]["split"].get("error")}
        if "error" in record["split_overhead"] and record["parts"]["split"]["status"] == "ok":
            record["parts"]["split"].update(status="failed", error=record["split_overhead"]["error"][:200])
        for row in record["split_overhead"].get("rows", []):
            print(f"split overhead {row['block']:<6} (B+W)/fused {row['ours_ratio']['median']:.3f}")
        if record["tests"].get("summary"):
            print(f"tests/gpu: {record['tests']['summary']}")
        record["goals_failed"] = _goals(record, args.device)
        broken = [name for name, part in record["parts"].items() if part["status"] != "ok"]
        record["status"] = "parts failed: " + ", ".join(broken) if broken else "complete"
        code = EXIT_PART if broken else EXIT_GOAL if record["goals_failed"] else EXIT_OK
    except Interrupted as stop:
        record["status"] = f"interrupted ({stop})"
        code = EXIT_PART
    except Exception as error:  # a bug of the check itself: still a JSON, and a part's exit status
        traceback.print_exc()
        record["status"] = f"crashed: {type(error).__name__}: {error}"
        code = EXIT_PART
    finally:
        record["environment"] = environment.finish()
        _save(args.out, record)
        if keep is not None:
            keep.cleanup()
    record["exit_code"] = code
    _save(args.out, record)
    print(f"[gpu_check] {record['status']}; goals failed: {record.get('goals_failed')}; exit {code}")
    print(f"written: {args.out}")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the script itself")
    parser.add_argument("--steps", type=int, default=5, help="steps per plan; the first is warm-up (default 5)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default all)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default all)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated (default all)")
    parser.add_argument("--profile-repeats", type=int, default=10, help="timed runs per profiled graph (default 10)")
    parser.add_argument("--split-repeats", type=int, default=30, help="split-overhead repeats (default 30)")
    parser.add_argument("--split-sequence", type=int, default=128, help="split-overhead tokens (default 128)")
    parser.add_argument("--split-blocks", default="llama,moe,mamba", help="split-overhead blocks (default all)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together (default 450)")
    parser.add_argument("--tests-timeout", type=float, default=210.0, help="seconds for tests/gpu (default 210)")
    parser.add_argument("--test-timeout", type=float, default=90.0, help="seconds per test (pytest-timeout; 90)")
    parser.add_argument("--plans-timeout", type=float, default=180.0, help="seconds for part (b) (default 180)")
    parser.add_argument("--split-timeout", type=float, default=60.0, help="seconds for part (c) (default 60)")
    parser.add_argument("--logs", type=Path, default=None, help="keep each part's output here (default: dropped)")
    parser.add_argument("--part", choices=("plans",), help=argparse.SUPPRESS)  # how the check runs part (b)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first warms up)")
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        parser.error(f"unknown schedules {sorted(unknown)}; known: {', '.join(SCHEDULES)}")
    if args.part == "plans":
        return _plans_part(args)
    if args.device == "cuda" and not visible_gpus():
        print("gpu_check: torch sees no GPU here (use --device cpu to check the script itself)", file=sys.stderr)
        return EXIT_NO_GPU
    signal.signal(signal.SIGTERM, _on_sigterm)
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
