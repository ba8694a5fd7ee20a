"""Multiplexed F+B vs F then B on the expert-parallel MoE decoder (`moe-ep-4`), 2 gloo ranks on 2 CPU cores.

Workload: shared/benchmarks.md's ``moe-ep-4`` (4 MoE decoder layers, hidden 256,
8 experts top-2, FFN 688, micro-batch 4 x 128 tokens, fp32), experts sharded
over 2 ranks (dispatch and combine all-to-all, 1 MiB each way per exchange).
Each rank runs the stage of the 4 decoder layers (hidden states in and out, so
B has input gradients); each rank's process is pinned to its own core with one
thread. Per repetition, in this interleaved order, after a barrier each:

- ``seq-full``: ``forward`` of micro-batch i, then ``full_backward`` of micro-batch j;
- ``mux-full``: the same two as one multiplexed graph (``OverlapStage(backward="full")``);
- ``cat-full``: a control: the same one merged graph, but F then B in their own orders (no reordering);
- ``seq-B`` / ``mux-B``: the same with B (the input-gradient graph) instead of the fused backward.

Reported: median and 10th-90th percentile step time per variant, the per-repetition
time ratio mux/seq, the time each rank blocks in ``wait_tensor`` (the exposed
all-to-all time, including waiting for the other rank), and the fraction of
all-to-all time hidden: 1 - wait(mux) / wait(seq). Also the pass's own prediction
(simulated with per-node times measured here, averaged over both ranks, and a
measured all-to-all time). Outputs are checked equal to the separate graphs first.

    .venv/bin/python bench/multiplex_overlap.py [--repeats 15] [--warmup 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx

from octopipe.capture import split_model
from octopipe.examples import workload
from octopipe.examples.models import expert_parallel
from octopipe.transform import CostModel, ForwardContext, OverlapStage, compile_stage, measure_compute_us
from octopipe.transform.collectives import is_all_to_all, is_wait

WORKLOAD = "moe-ep-4"
VARIANTS = ("seq-full", "cat-full", "mux-full", "seq-B", "mux-B")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p10": percentile(values, 0.1), "p90": percentile(values, 0.9)}


class WaitClock:
    """Total time spent blocked in wait_tensor by instrumented graphs."""

    def __init__(self) -> None:
        self.blocked_ns = 0

    def wait(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter_ns()
        out = torch.ops._c10d_functional.wait_tensor.default(tensor)
        self.blocked_ns += time.perf_counter_ns() - start
        return out

    def instrument(self, gm: fx.GraphModule) -> None:
        """Route the graph's waits through this clock (in place)."""
        for node in gm.graph.nodes:
            if is_wait(node):
                node.target = self.wait
        gm.recompile()


def measure_a2a_us(buffer_shape: tuple[int, ...], group: dist.ProcessGroup, repeats: int = 20) -> float:
    x = torch.randn(buffer_shape)
    splits = [buffer_shape[0] // 2] * 2
    samples = []
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter_ns()
        out = torch.ops._c10d_functional.all_to_all_single(x, splits, splits, str(group.group_name))
        torch.ops._c10d_functional.wait_tensor(out)
        samples.append((time.perf_counter_ns() - start) / 1000.0)
    return statistics.median(samples)


def averaged(table: dict[fx.Node, float], order: list[fx.Node]) -> dict[fx.Node, float]:
    """Per-node times averaged over the ranks (same graphs, so the same node order on every rank)."""
    values = torch.tensor([table.get(n, 0.0) for n in order], dtype=torch.float64)
    dist.all_reduce(values)
    return {n: float(v) / dist.get_world_size() for n, v in zip(order, values.tolist(), strict=True)}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)

    w = workload(WORKLOAD)
    model = expert_parallel(w.model(seed=0), group)
    names = model.pipeline_layers()
    stage = split_model(model, [names[:1], names[1:-1], names[-1:]])[1]
    hidden = w.config.hidden
    generator = torch.Generator().manual_seed(1000 + rank)
    shape = (w.microbatch_size, w.sequence, hidden)
    xs = [torch.randn(shape, generator=generator) for _ in range(2)]
    grad = torch.randn(shape, generator=generator)
    start = time.perf_counter()
    exe = compile_stage(stage, [xs[0]], stage_index=1)
    capture_s = time.perf_counter() - start

    # cost model: per-node compute measured here (averaged over ranks), one all-to-all measured
    _, ctx = exe.forward([xs[1]])
    fw_args = [*exe.params, *exe.buffers, xs[0]]
    bw_args = [*(ctx.saved or []), grad]
    b_args = [bw_args[i] for i in exe.split.b_inputs]
    compute: dict[fx.Node, float] = {}
    for gm, gm_args in (
        (exe.graphs.forward, fw_args),
        (exe.graphs.backward, bw_args),
        (exe.split.backward_input, b_args),
    ):
        order = [n for n in gm.graph.nodes if n.op == "call_function"]
        compute |= averaged(measure_compute_us(gm, gm_args, repeats=2), order)
    issue = next(n for n in exe.graphs.forward.graph.nodes if is_all_to_all(n))
    buffer_shape = tuple(issue.all_input_nodes[0].meta["val"].shape)
    a2a_us = measure_a2a_us(buffer_shape, group)
    costs = CostModel(compute_us=lambda n: compute.get(n, 0.0), comm_us=lambda n: a2a_us if is_all_to_all(n) else 0.0)
    overlaps = {
        "full": OverlapStage(exe, exe, backward="full", costs=costs),
        "B": OverlapStage(exe, exe, backward="input", costs=costs),
    }
    control = OverlapStage(exe, exe, backward="full", costs=costs, overlap=False)

    # outputs equal the separate graphs, bitwise
    for kind, overlap in overlaps.items():
        _, ctx_j = exe.forward([xs[1]])
        out_i, _ = exe.forward([xs[0]])
        if kind == "full":
            separate_in, separate_params = exe.full_backward(ctx_j, grad)
        else:
            separate_in, _ = exe.backward_input(ctx_j, grad)
        _, ctx_j = exe.forward([xs[1]])
        result = overlap.run([xs[0]], ctx_j, grad)
        assert torch.equal(result.output, out_i) and result.input_grads[0] is not None
        assert separate_in[0] is not None and torch.equal(result.input_grads[0], separate_in[0])
        if kind == "full":
            assert result.param_grads is not None
            assert all(
                a is None or b is None or torch.equal(a, b)
                for a, b in zip(result.param_grads, separate_params, strict=True)
            )

    clock = WaitClock()
    for gm in (exe.graphs.forward, exe.graphs.backward, exe.split.backward_input):
        clock.instrument(gm)
    for overlap in [*overlaps.values(), control]:
        clock.instrument(overlap.multiplexed.graph)

    runs: dict[str, Callable[[ForwardContext], object]] = {}

    def prepare() -> ForwardContext:
        return exe.forward([xs[1]])[1]

    runs["seq-full"] = lambda ctx: (exe.forward([xs[0]]), exe.full_backward(ctx, grad))
    runs["cat-full"] = lambda ctx: control.run([xs[0]], ctx, grad)
    runs["mux-full"] = lambda ctx: overlaps["full"].run([xs[0]], ctx, grad)
    runs["seq-B"] = lambda ctx: (exe.forward([xs[0]]), exe.backward_input(ctx, grad))
    runs["mux-B"] = lambda ctx: overlaps["B"].run([xs[0]], ctx, grad)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    waits: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for index in range(args.warmup + args.repeats):
        for variant in VARIANTS:
            ctx = prepare()
            dist.barrier(group)
            clock.blocked_ns = 0
            start_ns = time.perf_counter_ns()
            runs[variant](ctx)
            elapsed = (time.perf_counter_ns() - start_ns) / 1e6
            if index >= args.warmup:
                times[variant].append(elapsed)
                waits[variant].append(clock.blocked_ns / 1e6)

    reports = {kind: overlap.multiplexed.report for kind, overlap in overlaps.items()}
    mine = {
        "rank": rank,
        "capture_s": capture_s,
        "a2a_us": a2a_us,
        "a2a_bytes_sent": int(torch.Size(buffer_shape).numel() * 4 // 2),
        "times": times,
        "waits": waits,
        "predicted": {
            kind: {
                "hidden_fraction": r.hidden_fraction,
                "simulated_speedup": r.speedup,
                "comm_us": r.multiplexed.comm_us,
                "comms": len(r.comms),
                "hideable_fraction_min": min(c.hideable_fraction for c in r.comms),
            }
            for kind, r in reports.items()
        },
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(result_path).write_text(json.dumps(gathered))
        print(reports["full"].format())
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "multiplex_overlap.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = args.out.with_suffix(".ranks.json")
    load_before = os.getloadavg()
    mp.start_processes(rank_main, args=(2, free_port(), args, str(scratch)), nprocs=2, start_method="spawn")
    ranks = json.loads(scratch.read_text())
    scratch.unlink()
    load_after = os.getloadavg()

    rows = {}
    for kind in ("full", "B"):
        seq, mux = f"seq-{kind}", f"mux-{kind}"
        per_rank = []
        for r in ranks:
            ratio = [m / s for m, s in zip(r["times"][mux], r["times"][seq], strict=True)]
            wait_seq, wait_mux = statistics.median(r["waits"][seq]), statistics.median(r["waits"][mux])
            per_rank.append(
                {
                    "rank": r["rank"],
                    "seq_ms": summary(r["times"][seq]),
                    "mux_ms": summary(r["times"][mux]),
                    "ratio_mux_over_seq": summary(ratio),
                    "wait_seq_ms": summary(r["waits"][seq]),
                    "wait_mux_ms": summary(r["waits"][mux]),
                    "hidden_fraction": 1.0 - wait_mux / wait_seq if wait_seq > 0 else 0.0,
                    "predicted": r["predicted"][kind],
                }
            )
            if kind == "full":  # the control: one merged graph, not reordered
                cat = r["times"]["cat-full"]
                per_rank[-1]["control_cat_ms"] = summary(cat)
                per_rank[-1]["control_wait_cat_ms"] = summary(r["waits"]["cat-full"])
                per_rank[-1]["ratio_mux_over_cat"] = summary([m / c for m, c in zip(r["times"][mux], cat, strict=True)])
        rows[kind] = per_rank

    print(
        f"\n{WORKLOAD}: one F + one {{full backward | B}} of the 4-layer EP stage, 2 gloo ranks (1 core, 1 thread each), "
        f"median [p10, p90] over {args.repeats} interleaved runs"
    )
    print(
        f"{'backward':<9} {'rank':>4} {'F then B ms':>24} {'multiplexed ms':>24} {'mux/seq':>22} "
        f"{'wait seq ms':>12} {'wait mux ms':>12} {'a2a hidden':>10} {'predicted':>10}"
    )
    for kind, per_rank in rows.items():
        for row in per_rank:
            s, m, q = row["seq_ms"], row["mux_ms"], row["ratio_mux_over_seq"]
            print(
                f"{kind:<9} {row['rank']:>4} {s['median']:>8.1f} [{s['p10']:.1f}, {s['p90']:.1f}] "
                f"{m['median']:>8.1f} [{m['p10']:.1f}, {m['p90']:.1f}] {q['median']:>6.3f} [{q['p10']:.3f}, {q['p90']:.3f}] "
                f"{row['wait_seq_ms']['median']:>12.2f} {row['wait_mux_ms']['median']:>12.2f} "
                f"{row['hidden_fraction']:>10.1%} {row['predicted']['hidden_fraction']:>10.1%}"
            )
    for row in rows["full"]:
        c, q, wc = row["control_cat_ms"], row["ratio_mux_over_cat"], row["control_wait_cat_ms"]
        print(
            f"control, rank {row['rank']}: F and full backward merged but not reordered {c['median']:.1f} "
            f"[{c['p10']:.1f}, {c['p90']:.1f}] ms, wait {wc['median']:.2f} ms; mux/control {q['median']:.3f} "
            f"[{q['p10']:.3f}, {q['p90']:.3f}]"
        )
    first = ranks[0]
    print(
        f"all-to-all: {first['predicted']['full']['comms']} per multiplexed step, {first['a2a_bytes_sent'] / 2**20:.2f} MiB "
        f"sent per exchange, measured {first['a2a_us']:.0f} us alone (rank 0); capture {first['capture_s']:.1f} s"
    )
    meta = {
        "workload": WORKLOAD,
        "torch": torch.__version__,
        "ranks": 2,
        "threads_per_rank": 1,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "variants": list(VARIANTS),
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before[0], load_after[0]],
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "ranks": ranks}, indent=2) + "\n")
    print(f"1-minute load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
