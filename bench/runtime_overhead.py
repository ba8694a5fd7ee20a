"""Where a pipeline step's time goes, per action, on every standard workload: the runtime's breakdown.

Two parts, each under both host allocator policies (``transform.host_memory``:
``system``, the C library's defaults and how octopipe ran before, and ``reuse``,
how it runs now), so the table shows the cost before and after.

**Graphs** (one process per workload and policy, one thread pinned to one core):
for each stage of the 2-rank equal partition and one micro-batch, torch's eager
module forward (autograd recording, as torch's pipelining runs it) and backward
(autograd, fused) against octopipe's captured F, fused backward, I and W graphs:
median ms over ``--repeats`` interleaved runs, page faults per call, graph
nodes, and what binding every op directly (skipping ``OpOverload.__call__``)
would save per call (the Python dispatch the graph code pays per node).

**Pipeline** (``run_local``, 2 gloo ranks on 2 distinct cores): torch's 1F1B and
ZBV orders run by octopipe. Per rank and step: compute (the computations' own
time), waiting for messages (``ActionRecord.wait_ns``), the communication
actions on the program's thread (posting a send or a receive: the hand-off to
the channel thread), and the rest (the interpreter and its bookkeeping between
actions); page faults per step; each computation's median time in the pipeline
against the same graph timed alone; and, for every message a consumer waited
for, the time from its SEND starting on the sender to the consumer starting
(channel threads, gloo and the peer's core), against the idle link probe.

    .venv/bin/python bench/runtime_overhead.py [--workloads ...] [--repeats 7] [--steps 3] [--label after]

Results: ``results/runtime_overhead.json`` (one entry per ``--label``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch
from quiet import Environment, add_arguments, start
from vs_torch import WORKLOADS, same_order_plan

from octopipe.capture import split_model
from octopipe.execute.runtime import RunOptions, measured_step_times_us, run_local, workload_reference
from octopipe.execute.runtime.linkprobe import measure_link
from octopipe.execute.runtime.models import build_model
from octopipe.execute.runtime.pinning import online_cpus
from octopipe.execute.runtime.stages import split_batch
from octopipe.ir import ActionKind, parse_action
from octopipe.transform import StageCompiler, StageExecutable, configure_host_memory
from octopipe.tune import equal_partition

RESULTS = Path(__file__).resolve().parent / "results" / "runtime_overhead.json"
POLICIES = ("system", "reuse")
PIPELINE_ORDERS = ("Schedule1F1B", "ScheduleZBVZeroBubble")
M = 8
_BACKWARDS = (ActionKind.BACKWARD_INPUT, ActionKind.FULL_BACKWARD)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def direct_call(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``gm`` with every ``torch.ops.aten.*.*`` call bound to the operator itself (no ``OpOverload.__call__``)."""
    code = gm.graph.python_code(root_module="self")
    scope = dict(code.globals)

    def bind(match: re.Match[str]) -> str:
        target: Any = torch.ops
        for part in match.group(1).split(".")[2:]:
            target = getattr(target, part)
        name = "_direct_" + match.group(1).replace(".", "_")
        scope[name] = target._op
        return name + "("

    exec(compile(re.sub(r"(torch\.ops\.aten\.\w+\.\w+)\(", bind, code.src), "<direct>", "exec"), scope)
    forward = scope["forward"]
    return lambda *args: forward(gm, *args)


def reference_of(workload: str, tiny: bool) -> Any:
    return workload_reference(workload, tiny=True, sequence=16) if tiny else workload_reference(workload)


def _time_stage(
    stage: torch.nn.Module, exe: StageExecutable, inputs: list[torch.Tensor], grad: torch.Tensor, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Every variant of one stage, interleaved, ``repeats`` times after 2 warm-up rounds: ms and page faults."""
    graphs = exe.graphs
    fast_fw, fast_bw = direct_call(graphs.forward), direct_call(graphs.backward)
    flat = [*exe.params, *exe.buffers, *inputs]
    times: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}
    keep = False

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        f0, t0 = _faults(), time.perf_counter_ns()
        result = fn()
        t1, f1 = time.perf_counter_ns(), _faults()
        if keep:
            times.setdefault(key, []).append((t1 - t0) / 1e6)
            faults.setdefault(key, []).append(f1 - f0)
        return result

    def eager() -> None:  # torch eager, as its pipelining runs a stage: autograd records the forward
        x = inputs[0].detach().requires_grad_(inputs[0].is_floating_point())
        y = timed("eager F", lambda: stage(x, *inputs[1:]))
        timed("eager B", lambda: y.backward(grad))
        for p in stage.parameters():
            p.grad = None

    def ours() -> None:  # F then the fused backward; F then I and W (as zero-bubble schedules run them)
        _, ctx = timed("ours F", lambda: exe.forward_all(inputs))
        timed("ours B (fused)", lambda: exe.full_backward_all(ctx, [grad]))
        _, ctx2 = exe.forward_all(inputs)
        _, wctx = timed("ours I", lambda: exe.backward_input_all(ctx2, [grad]))
        timed("ours W", lambda: exe.backward_weight(wctx))

    def direct() -> None:  # the same graphs with every op bound directly: the Python dispatch per node
        with torch.no_grad():
            out = timed("direct F", lambda: fast_fw(*flat))
            saved = list(out[graphs.num_outputs :])
            del out
            timed("direct B (fused)", lambda: fast_bw(*saved, grad))

    variants = [eager, ours, direct]
    for repeat in range(repeats + 2):
        keep = repeat >= 2
        for offset in range(len(variants)):  # each repeat starts one further along: no variant always runs first
            variants[(repeat + offset) % len(variants)]()
    return times, faults


def graphs_child(workload: str, policy: str, repeats: int, tiny: bool = False) -> dict[str, Any]:
    """Part 1 for one workload under one policy (this process: pinned, one thread)."""
    os.sched_setaffinity(0, {online_cpus()[-1]})
    torch.set_num_threads(1)
    memory = configure_host_memory(policy)
    built = build_model(reference_of(workload, tiny))
    stages = list(split_model(built.model, equal_partition(built.model.pipeline_layers(), 2)))  # type: ignore[operator]
    tokens, targets = split_batch(*built.batch(0), M)[0]
    with torch.no_grad():
        boundary = stages[0](tokens)
    compiler = StageCompiler()
    rows = []
    partition = equal_partition(built.model.pipeline_layers(), 2)  # type: ignore[operator]
    for index, inputs in ((0, [tokens]), (1, [boundary, targets])):
        exe = compiler.executable(stages[index], inputs, stage_index=index)
        grad = torch.randn_like(boundary) if index == 0 else torch.ones(()) / M
        times, faults = _time_stage(stages[index], exe, inputs, grad, repeats)
        split = exe.split
        rows.append(
            {
                "stage": index,
                "layers": len(partition[index]),
                "nodes": {
                    "F": len(exe.graphs.forward.graph.nodes),
                    "B (fused)": len(exe.graphs.backward.graph.nodes),
                    "I": len(split.backward_input.graph.nodes),
                    "W": len(split.backward_weight.graph.nodes),
                },
                "median_ms": {k: statistics.median(v) for k, v in times.items()},
                "faults_per_call": {k: statistics.median(v) for k, v in faults.items()},
            }
        )
    return {"workload": workload, "policy": policy, "host_memory": memory.as_json(), "stages": rows}


def graphs_part(workloads: list[str], repeats: int, tiny: bool) -> list[dict[str, Any]]:
    """Part 1: one fresh process per workload and policy (the policy acts on the whole process)."""
    results = []
    for workload in workloads:
        for policy in POLICIES:
            done = subprocess.run(
                [sys.executable, __file__, "--graphs-child", workload, policy, str(repeats), str(int(tiny))],
                capture_output=True,
                text=True,
                check=True,
                timeout=3600,
            )
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  graphs: {workload} ({policy}) done", flush=True)
    return results


def _consumer(action: str) -> tuple[int, int, str] | None:
    """(stage, micro-batch, direction) a message of this SEND feeds: a SEND_F feeds stage + 1's forward."""
    parsed = parse_action(action)
    if parsed.kind is ActionKind.SEND_F:
        return (parsed.stage + 1, parsed.microbatch or 0, "F")
    if parsed.kind is ActionKind.SEND_B:
        return (parsed.stage - 1, parsed.microbatch or 0, "B")
    return None


def pipeline_part(
    workloads: list[str], steps: int, env: Environment, tiny: bool, orders: list[str]
) -> list[dict[str, Any]]:
    """Part 2: octopipe running torch's orders on 2 ranks, under each policy."""
    rows = []
    for workload in workloads:
        reference = reference_of(workload, tiny)
        for order in orders:
            plan = same_order_plan(order, reference)
            for policy in POLICIES:
                result = run_local(plan, RunOptions(steps=steps, timeout_s=900, host_memory=policy))
                env.record(result.cores)
                rows.append({"workload": workload, "order": order, "policy": policy, **_breakdown(result)})
                print(f"  pipeline: {workload} {order} ({policy}) done", flush=True)
    return rows


def _breakdown(result: Any) -> dict[str, Any]:
    steps_us = measured_step_times_us(result)[1:]
    ranks: dict[str, Any] = {}
    starts: dict[tuple[int, int, int, str], int] = {}  # (step, consumer stage, mb, direction) -> its SEND's start
    per_kind: dict[str, list[float]] = {}
    deliveries: list[float] = []
    for rank, timelines in sorted(result.timelines.items()):
        parts: dict[str, list[float]] = {k: [] for k in ("step", "compute", "wait", "comm", "rest", "faults")}
        for timeline in timelines[1:]:
            compute = wait = comm = 0
            faults = 0
            for record in timeline.records:
                span = record.end_ns - record.start_ns
                wait += record.wait_ns
                faults += record.minor_faults
                action = parse_action(record.action)
                if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B):
                    comm += span
                else:
                    compute += span
                    kind = action.kind.name if action.kind is not ActionKind.OVERLAP_F_B else "OVERLAP_F_B"
                    per_kind.setdefault(f"stage {action.stage} {kind}", []).append(span / 1e6)
            total = timeline.end_ns - timeline.start_ns
            for key, value in (("step", total), ("compute", compute), ("wait", wait), ("comm", comm)):
                parts[key].append(value / 1e6)
            parts["rest"].append((total - compute - wait - comm) / 1e6)
            parts["faults"].append(faults)
        ranks[str(rank)] = {k: statistics.median(v) for k, v in parts.items()}
    # message delivery: SEND start on the sender -> the consumer's start, for consumers that waited
    for timelines in result.timelines.values():
        for step, timeline in enumerate(timelines[1:], start=1):
            for record in timeline.records:
                consumer = _consumer(record.action)
                if consumer is not None:
                    starts[(step, *consumer)] = record.start_ns
    for timelines in result.timelines.values():
        for step, timeline in enumerate(timelines[1:], start=1):
            for record in timeline.records:
                action = parse_action(record.action)
                direction = "F" if action.kind is ActionKind.FORWARD else "B"
                sent = starts.get((step, action.stage, action.microbatch or 0, direction))
                waited = record.wait_ns > 10_000  # 10 us: more than looking at a completed receive takes
                if sent is not None and waited and action.kind in (ActionKind.FORWARD, *_BACKWARDS):
                    deliveries.append((record.start_ns - sent) / 1e3)
    return {
        "step_ms": statistics.median(steps_us) / 1e3,
        "ranks": ranks,
        "computation_ms": {k: statistics.median(v) for k, v in sorted(per_kind.items())},
        "waited_deliveries_us": {
            "count": len(deliveries),
            "median": statistics.median(deliveries) if deliveries else None,
            "max": max(deliveries) if deliveries else None,
        },
        "host_memory": {str(r): m for r, m in result.host_memory.items()},
    }


def print_tables(record: dict[str, Any]) -> None:
    print("\ngraphs, one micro-batch, one thread (median ms; page faults per call)")
    print(
        f"{'workload':<13}{'stage':>6}{'policy':>8} | {'eager F':>8}{'ours F':>8} | {'eager B':>8}{'ours B':>8}"
        f"{'I':>8}{'W':>8}{'I+W':>8} | {'F/eagerF':>9}{'B/eagerB':>9} | {'faults eB':>9}{'oB':>7} | {'direct':>7}"
    )
    for entry in record["graphs"]:
        for row in entry["stages"]:
            t, f = row["median_ms"], row["faults_per_call"]
            saving = (t["ours F"] - t["direct F"]) + (t["ours B (fused)"] - t["direct B (fused)"])
            print(
                f"{entry['workload']:<13}{row['stage']:>6}{entry['policy']:>8} | {t['eager F']:>8.1f}{t['ours F']:>8.1f}"
                f" | {t['eager B']:>8.1f}{t['ours B (fused)']:>8.1f}{t['ours I']:>8.1f}{t['ours W']:>8.1f}"
                f"{t['ours I'] + t['ours W']:>8.1f} | {t['ours F'] / t['eager F']:>9.3f}"
                f"{t['ours B (fused)'] / t['eager B']:>9.3f} | {f['eager B']:>9.0f}{f['ours B (fused)']:>7.0f}"
                f" | {saving:>7.2f}"
            )
    print("\npipeline, 2 ranks, octopipe running torch's order (median per step, ms; faults per step)")
    print(
        f"{'workload':<13}{'order':<23}{'policy':>7}{'step':>8} | "
        + " | ".join(f"r{r} {'compute':>7}{'wait':>7}{'comm':>6}{'rest':>6}{'faults':>8}" for r in (0, 1))
        + f" | {'delivery us':>11}"
    )
    for row in record["pipeline"]:
        cells = []
        for r in ("0", "1"):
            p = row["ranks"][r]
            cells.append(
                f"   {p['compute']:>7.0f}{p['wait']:>7.0f}{p['comm']:>6.1f}{p['rest']:>6.1f}{p['faults']:>8.0f}"
            )
        delivery = row["waited_deliveries_us"]["median"]
        print(
            f"{row['workload']:<13}{row['order'].removeprefix('Schedule'):<23}{row['policy']:>7}{row['step_ms']:>8.0f} | "
            + " | ".join(cells)
            + f" | {delivery if delivery is None else round(delivery):>11}"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--graphs-child":
        print(json.dumps(graphs_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1")))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per graph (after 2 warm-up)")
    parser.add_argument("--label", default="after", help="names the version measured (before/after)")
    parser.add_argument("--parts", nargs="+", choices=["graphs", "pipeline"], default=["graphs", "pipeline"])
    parser.add_argument("--orders", nargs="+", default=list(PIPELINE_ORDERS), help="torch schedule classes")
    add_arguments(parser, rounds=1, steps=3)
    args = parser.parse_args()
    env = start(parser, args)
    link, _ = measure_link()
    record: dict[str, Any] = {"label": args.label, "tiny": args.tiny, "probed_link_latency_us": link.latency_us}
    record["graphs"] = graphs_part(args.workloads, args.repeats, args.tiny) if "graphs" in args.parts else []
    record["pipeline"] = (
        pipeline_part(args.workloads, args.steps, env, args.tiny, args.orders) if "pipeline" in args.parts else []
    )
    record["environment"] = env.finish()
    print_tables(record)
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    kept = [r for r in existing.get("breakdowns", []) if r.get("label") != args.label]
    history = {"runs": existing["runs"]} if "runs" in existing else {}  # the replay figures of issue 14
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"breakdowns": [*kept, record], **history}, indent=2) + "\n")
    print(f"written: {RESULTS}")


if __name__ == "__main__":
    main()
