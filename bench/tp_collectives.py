"""Tensor-parallel collectives: the simulator's per-layer prediction vs the time measured inside the layer, tp=2.

For each layer kind of the standard workloads (shared/benchmarks.md: llama-8's
attention+SwiGLU block, nemotronh-16's Mamba-2 mixer, squared-ReLU MLP and
attention blocks; hidden 256, micro-batch 4 x 128 tokens) on two gloo processes
pinned to two distinct cores:

1. the link: ``linkprobe.measure_link`` (the profile's pipeline link, latency and
   bandwidth of a one-way transfer between the two pinned ranks);
2. the layer is split over the 2 ranks (``runtime.tensor_parallel``) and
   captured; the all-reduce volumes and counts come from the captured forward
   and input-gradient graphs (every ``all_reduce`` node's input bytes);
3. **predicted**: ``octopipe.simulate.tensor_parallel.traffic_us`` for those
   volumes over the measured link (ring all-reduce, 2 ((n-1)/n B / bw + c (n-1) lat));
4. **measured**: the layer's F and its input-gradient backward (I) are timed
   ``--repeats`` times with the all-reduces and again as the same graphs on
   the same slices with the collectives' hooks removed (the same local compute,
   no communication), each repeat after a barrier; the collective time is the
   difference of the medians, per direction.

The error is (predicted - measured) / measured. On this machine the two ranks
are two cores of one CPU and gloo runs over loopback, so the "link" is memory
copies through the kernel's TCP stack.

The measured time is taken from the last rank's arrival (each all-reduce's
issue and return are clocked on both ranks: end minus the later issue), so a
rank waiting for a slower partner is not counted as communication; "with-w/o"
(the difference of the layer's medians) is printed beside it. A layer's
measured time is the sum of its collectives' medians. ``--pin before`` pins
each rank to its core before ``init_process_group``, as the runtime's workers
do, so gloo's own threads share that core with the rank's thread; in this
harness most 512 KB all-reduces then took 2-5 ms (waiting, it seems, for a
scheduler tick) against 0.6-0.8 ms with ``--pin after`` (the default: gloo's
threads keep the whole mask). Freeing gloo's threads in the runtime's workers
did not change a tp=2 or a dp=2 llama-8 step measurably (2337 vs 2326 ms,
1494 vs 1589 ms, one run each), so the runtime keeps its pinning.

    .venv/bin/python bench/tp_collectives.py [--repeats 60] [--pin after|before]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quiet import Environment, percentile, require_quiet, write_record

from octopipe.examples.models import ModelConfig
from octopipe.examples.models.decoder import Block
from octopipe.execute.processes import free_port
from octopipe.execute.runtime.linkprobe import fit_link, measure_link
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.execute.runtime.tensor_parallel import tensor_parallel
from octopipe.simulate import Link
from octopipe.simulate.collectives import all_reduce_us
from octopipe.simulate.tensor_parallel import ParallelTraffic, traffic_us
from octopipe.transform import StageExecutable, compile_stage
from octopipe.transform.collectives import COLLECTIVE_KINDS, is_collective, packet

#: (workload, layer kind): the standard workloads' block kinds (ModelConfig defaults: hidden 256)
LAYERS = (
    ("llama-8", ("attention", "swiglu")),
    ("nemotronh-16", ("mamba2", "none")),
    ("nemotronh-16", ("none", "relu2")),
    ("nemotronh-16", ("attention", "none")),
)
BATCH, SEQUENCE = 4, 128  # one micro-batch of the standard workloads (global 32 / 8 micro-batches)
PROBE_SIZES = (4, 64 << 10, 256 << 10, 512 << 10, 1 << 20)
_functional = torch.ops._c10d_functional


def all_reduce_link(probe: list[tuple[int, float]]) -> Link:
    """The tp group's per-hop link from all-reduces alone on 2 ranks: t(B) = 2 (B / 2 / bw + lat), fitted as
    linkprobe fits a one-way link (the smallest size's time is the latency, the slope through the origin of
    the rest the bandwidth)."""
    latency, bandwidth = fit_link([(b, t / 2) for b, t in probe])  # t / 2 = lat + B / (2 bw)
    return Link(latency_us=latency, bandwidth_bytes_per_second=bandwidth / 2)


def _all_reduces(graph: torch.fx.GraphModule) -> tuple[int, int]:
    """(bytes, count) of the all-reduces a captured graph issues (their inputs' sizes from the trace)."""
    total = count = 0
    for node in graph.graph.nodes:
        if is_collective(node) and COLLECTIVE_KINDS.get(str(getattr(packet(node), "__name__", ""))) == "all_reduce":
            value = node.args[0].meta["val"]
            total += value.numel() * value.element_size()
            count += 1
    return total, count


class _Marks:
    """Clock readings (perf_counter, one clock for both processes of this machine) around each all-reduce."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float, float]] = []  # (graph, issued, waited) per all-reduce, in order
        self._issued = 0.0

    def issue(self, tensor: torch.Tensor) -> None:
        self._issued = time.perf_counter()

    def done(self, tensor: torch.Tensor, graph: str) -> None:
        self.times.append((graph, self._issued, time.perf_counter()))


def _instrument(gm: torch.fx.GraphModule, marks: _Marks, name: str) -> None:
    """Read the clock just before each all-reduce is issued and just after its wait returns."""
    graph = gm.graph
    for node in list(graph.nodes):
        if is_collective(node) and COLLECTIVE_KINDS.get(str(getattr(packet(node), "__name__", ""))) == "all_reduce":
            with graph.inserting_before(node):
                graph.call_function(marks.issue, (node.args[0],))
            wait = next(iter(node.users))
            with graph.inserting_after(wait):
                graph.call_function(marks.done, (wait, name))
    gm.recompile()


def _time(exe: StageExecutable, x: torch.Tensor, grad: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    forward, backward = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _, ctx = exe.forward([x])
        middle = time.perf_counter()
        exe.backward_input(ctx, grad)
        end = time.perf_counter()
        forward.append((middle - start) * 1e6)
        backward.append((end - middle) * 1e6)
    return forward[repeats // 5 :], backward[repeats // 5 :]  # the first fifth is warm-up


def _rank(rank: int, world: int, port: int, repeats: int, out: str, pin: str) -> None:
    if pin == "before":  # as the runtime's workers do: gloo's threads, started by the init, inherit the one core
        cores, _ = pin_rank(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    if pin == "after":  # this thread on its core; gloo's own threads keep the whole mask
        cores, _ = pin_rank(rank)
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    probe = []  # the tp group's own all-reduce, alone: (bytes, median us) per size
    for size in PROBE_SIZES:
        samples = []
        for _ in range(repeats):
            x = torch.randn(size // 4)
            dist.barrier()
            start = time.perf_counter()
            _functional.wait_tensor(_functional.all_reduce(x, "sum", group.group_name))
            samples.append((time.perf_counter() - start) * 1e6)
        probe.append((size, statistics.median(samples[repeats // 5 :]), samples[repeats // 5 :]))
    rows = []
    for workload, (mixer, ffn) in LAYERS:
        torch.manual_seed(0)
        config = ModelConfig()
        x = torch.randn(BATCH, SEQUENCE, config.hidden)
        grad = torch.randn_like(x)
        timed = {}
        for split in ("with", "without"):
            torch.manual_seed(0)
            block = Block(mixer, ffn, config)
            tensor_parallel(block, group)
            if split == "without":  # the same slices and local compute, no collectives
                for module in block.modules():
                    module._forward_hooks.clear()
                    module._forward_pre_hooks.clear()
            exe = compile_stage(block, [x])
            marks = _Marks()
            if split == "with":
                volumes = (_all_reduces(exe.graphs.forward), _all_reduces(exe.split.backward_input))
                _instrument(exe.graphs.forward, marks, "F")
                _instrument(exe.split.backward_input, marks, "I")
            timed[split] = _time(exe, x, grad, repeats)
            if split == "with":
                both: list[list[tuple[str, float, float]]] = [[], []]
                dist.all_gather_object(both, marks.times)
                per = len(both[0]) // repeats  # all-reduces per repeat
                each: dict[int, list[float]] = {}  # collective (its place in a repeat) -> its times
                where: dict[int, str] = {}
                for index, ((graph, issued, waited), (_, other, _)) in enumerate(zip(*both, strict=True)):
                    if index // per >= repeats // 5:  # the first fifth is warm-up
                        each.setdefault(index % per, []).append((waited - max(issued, other)) * 1e6)
                        where[index % per] = graph
                # a layer's collective time: the sum of its collectives' medians (the median of per-repeat sums
                # lands in whichever mode of a bimodal collective two draws make more likely)
                after_last = [sum(statistics.median(v) for k, v in each.items() if where[k] == d) for d in ("F", "I")]
                spread = [
                    (
                        sum(percentile(v, 0.1) for k, v in each.items() if where[k] == d),
                        sum(percentile(v, 0.9) for k, v in each.items() if where[k] == d),
                    )
                    for d in ("F", "I")
                ]
        rows.append(
            {
                "workload": workload,
                "layer": "+".join(k for k in (mixer, ffn) if k != "none"),
                "forward_all_reduce": {"bytes": volumes[0][0], "count": volumes[0][1]},
                "backward_all_reduce": {"bytes": volumes[1][0], "count": volumes[1][1]},
                "with_us": [statistics.median(t) for t in timed["with"]],
                "without_us": [statistics.median(t) for t in timed["without"]],
                "after_last_arrival_us": after_last,
                "after_last_arrival_p10_p90_us": spread,
            }
        )
    if rank == 0:
        torch.save({"rows": rows, "probe": probe, "cores": {rank: cores}}, out)
    else:
        torch.save({"cores": {rank: cores}}, out + f".{rank}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed F + I per layer and variant (default: 60)")
    parser.add_argument("--max-load", type=float, default=0.8)
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")
    parser.add_argument(
        "--pin",
        choices=("before", "after"),
        default="after",
        help="pin each rank to its core before init_process_group (gloo's threads share that core, as the "
        "runtime's workers run today) or after it (gloo's threads free) (default: after)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/tp_collectives_<pin>.json")
    args = parser.parse_args()
    args.out = args.out or Path(f"bench/results/tp_collectives_{args.pin}.json")
    require_quiet(args.max_load, force=args.force)
    environment = Environment(forced=args.force)
    cost, points = measure_link()
    link = Link.from_proto(cost)
    print(f"link: latency {cost.latency_us:.1f} us, bandwidth {cost.bandwidth_bytes_per_second / 1e9:.2f} GB/s")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.pt")
        mp.start_processes(_rank, args=(2, free_port(), args.repeats, out, args.pin), nprocs=2, start_method="spawn")
        data = torch.load(out, weights_only=False)
        other = torch.load(out + ".1", weights_only=False)
    environment.record({**data["cores"], **other["cores"]})
    group_link = all_reduce_link([(b, t) for b, t, _ in data["probe"]])
    print("all-reduce alone on the 2 ranks (median us, p10-p90):")
    for size, median, samples in data["probe"]:
        low, high = percentile(samples, 0.1), percentile(samples, 0.9)
        print(f"  {size:>8} B  {median:>7.0f}  ({low:.0f}-{high:.0f})  model {all_reduce_us(group_link, 2, size):.0f}")
    print(
        f"tp group link fitted to them: latency {group_link.latency_us:.1f} us per hop, "
        f"bandwidth {group_link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"
    )
    table: list[dict[str, Any]] = []
    print(
        f"{'layer':<22} {'dir':<3} {'bytes':>9} {'n':>2} {'predicted us':>12} {'measured us':>11} {'error':>7} "
        f"{'with-w/o':>9} {'p2p-link':>8}"
    )
    for row in data["rows"]:
        traffic = ParallelTraffic(
            tp=2,
            tp_forward_bytes=row["forward_all_reduce"]["bytes"],
            tp_forward_count=row["forward_all_reduce"]["count"],
            tp_backward_bytes=row["backward_all_reduce"]["bytes"],
            tp_backward_count=row["backward_all_reduce"]["count"],
        )
        predicted = traffic_us(traffic, group_link, None)
        from_p2p = traffic_us(traffic, link, None)
        for index, direction in enumerate(("F", "I")):
            measured = row["after_last_arrival_us"][index]
            in_situ = row["with_us"][index] - row["without_us"][index]
            volume = row["forward_all_reduce" if index == 0 else "backward_all_reduce"]
            error = (predicted[index] - measured) / measured if measured > 0 else float("nan")
            name = f"{row['workload']} {row['layer']}"
            print(
                f"{name:<22} {direction:<3} {volume['bytes']:>9} {volume['count']:>2} {predicted[index]:>12.0f} "
                f"{measured:>11.0f} {error:>+7.1%} {in_situ:>9.0f} {from_p2p[index]:>8.0f}"
            )
            table.append(
                {
                    **{k: row[k] for k in ("workload", "layer")},
                    "direction": direction,
                    "bytes": volume["bytes"],
                    "collectives": volume["count"],
                    "predicted_us": predicted[index],
                    "predicted_from_p2p_link_us": from_p2p[index],
                    "measured_us": measured,
                    "with_minus_without_us": in_situ,
                    "measured_p10_p90_us": row["after_last_arrival_p10_p90_us"][index],
                    "with_collectives_us": row["with_us"][index],
                    "without_collectives_us": row["without_us"][index],
                    "error": error,
                }
            )
    errors = [abs(r["error"]) for r in table]
    print(f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%} (goal <= 10%)")
    record = {
        "benchmark": "tp_collectives",
        "tp": 2,
        "pin": args.pin,
        "repeats": args.repeats,
        "link": {"latency_us": cost.latency_us, "bandwidth_bytes_per_second": cost.bandwidth_bytes_per_second},
        "link_points": points,
        "tp_group_link": {
            "latency_us": group_link.latency_us,
            "bandwidth_bytes_per_second": group_link.bandwidth_bytes_per_second,
        },
        "all_reduce_probe": [
            {"bytes": b, "median_us": t, "p10_us": percentile(x, 0.1), "p90_us": percentile(x, 0.9)}
            for b, t, x in data["probe"]
        ],
        "rows": table,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "environment": environment.finish(),
    }
    write_record(args.out, record)


if __name__ == "__main__":
    main()
