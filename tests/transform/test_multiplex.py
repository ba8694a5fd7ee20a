"""F of one micro-batch multiplexed with B (or the fused backward) of another, ordered so all-to-alls overlap compute.

On the expert-parallel MoE decoder on 2 gloo ranks: both halves' outputs are
bitwise those of the separately run graphs, and every all-to-all has compute
of the other half between its issue and its wait. Over random graphs
(hypothesis): the order never violates a dependency, keeps each half's
collectives and random ops in their own order, and alternates the halves'
collectives. Costs: the Profile-calibrated model sums to the profile.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx

from octopipe.capture import split_model
from octopipe.examples.models import ModelConfig, expert_parallel, moe_decoder
from octopipe.profile.v1 import profile_pb2
from octopipe.transform import (
    CostModel,
    OverlapStage,
    comm_bytes,
    compile_stage,
    measure_compute_us,
    multiplex,
    profile_costs,
    roofline_costs,
    simulate,
)
from octopipe.transform.collectives import is_all_to_all, is_collective, is_wait
from octopipe.transform.multiplexing import HALF_KEY
from tests.transform.gloo import default_group, run_ranks

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _is_compute(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and not (is_collective(node) or is_wait(node))
        and roofline_costs().compute_us(node) > 0
    )


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def ep_moe_stage(rank: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The middle stage (2 expert-parallel MoE layers) of the tiny MoE decoder, and this rank's two
    micro-batches and output gradient (inside ``run_ranks``: the experts are sharded over the world)."""
    torch.manual_seed(0)
    model = expert_parallel(moe_decoder(2, ModelConfig.tiny()), default_group())
    names = model.pipeline_layers()
    stage = split_model(model, [names[:1], names[1:-1], names[-1:]])[1]
    generator = torch.Generator().manual_seed(10 + rank)
    x0, x1, grad = (torch.randn(2, 8, 32, generator=generator) for _ in range(3))
    return stage, x0, x1, grad


def _multiplexed_ep_moe(rank: int, world: int) -> None:
    stage, x0, x1, grad = ep_moe_stage(rank)
    exe = compile_stage(stage, [x0], stage_index=1)
    kinds: tuple[Literal["full", "input"], ...] = ("full", "input")
    for kind in kinds:
        overlap = OverlapStage(exe, exe, backward=kind)
        # the separately run graphs: F of micro-batch 0, the backward of micro-batch 1
        _, ctx1 = exe.forward([x1])
        out0, ctx0 = exe.forward([x0])
        if kind == "full":
            input_grads, param_grads = exe.full_backward(ctx1, grad)
        else:
            input_grads, wctx = exe.backward_input(ctx1, grad)
            param_grads = exe.backward_weight(wctx)
        _, ctx1 = exe.forward([x1])
        result = overlap.run([x0], ctx1, grad)
        assert ctx1.saved is None and result.forward_ctx.saved is not None and ctx0.saved is not None
        assert torch.equal(result.output, out0)
        assert _same(list(result.forward_ctx.saved), list(ctx0.saved))
        assert _same(result.input_grads, input_grads)
        if kind == "full":
            assert result.weight_ctx is None and result.param_grads is not None
            assert _same(result.param_grads, param_grads)
        else:
            assert result.param_grads is None and result.weight_ctx is not None
            assert _same(exe.backward_weight(result.weight_ctx), param_grads)

        # every all-to-all has independent compute of the other half between its issue and its wait
        order = list(overlap.multiplexed.graph.graph.nodes)
        position = {n: i for i, n in enumerate(order)}
        issues = [n for n in order if is_all_to_all(n)]
        assert len(issues) == 8  # dispatch + combine for 2 layers, in F and in the backward
        for issue in issues:
            (wait,) = [u for u in issue.users if is_wait(u)]
            between = order[position[issue] + 1 : position[wait]]
            other = [n for n in between if _is_compute(n) and n.meta[HALF_KEY] != issue.meta[HALF_KEY]]
            assert other, f"{issue.name} ({issue.meta[HALF_KEY]}) has no compute of the other half in flight"
            assert all(issue not in _ancestors(n) for n in between)
        report = overlap.multiplexed.report
        assert [c.issue for c in report.comms] == [n.name for n in issues]
        assert all(c.other_half_between > 0 and c.compute_between_us > 0 for c in report.comms)
        assert 0 < report.hidden_fraction <= 1 and report.speedup > 1
        # the collective order is the same on every rank (it depends on the graphs only)
        orders: list[object] = [None] * world
        dist.all_gather_object(orders, [n.name for n in issues])
        assert orders[0] == orders[1]


def test_multiplexed_f_and_b_equal_separate_graphs_and_overlap_all_to_alls_on_two_ranks() -> None:
    run_ranks(_multiplexed_ep_moe, 2)


# ---- properties over random graphs (no process group: the graphs are built, ordered and checked, not run) ----

_OPS = {"unary": _aten.relu.default, "binary": _aten.add.Tensor, "random": _aten.rand_like.default}


@st.composite
def _half(draw: st.DrawFn, prefix: str) -> fx.GraphModule:
    graph = fx.Graph()
    values = [graph.placeholder(f"{prefix}in{i}") for i in range(draw(st.integers(1, 3)))]
    steps = draw(st.lists(st.sampled_from(["unary", "binary", "comm", "random"]), min_size=1, max_size=24))
    for index, step in enumerate(steps):
        a, b = (values[draw(st.integers(0, len(values) - 1))] for _ in range(2))
        if step == "comm":
            issue = graph.call_function(_c10d.all_to_all_single.default, (a, [1, 1], [1, 1], "0"))
            issue.meta.update(uid=f"{prefix}{index}c", cost=draw(st.floats(0, 50)))
            node = graph.call_function(_c10d.wait_tensor.default, (issue,))
        else:
            node = graph.call_function(_OPS[step], (a, b) if step == "binary" else (a,))
        node.meta.update(uid=f"{prefix}{index}", cost=draw(st.floats(0, 50)))
        values.append(node)
    graph.output(tuple(values[-draw(st.integers(1, min(3, len(values)))) :]))
    return fx.GraphModule(torch.nn.Module(), graph)


def _meta_costs() -> CostModel:
    return CostModel(
        compute_us=lambda n: float(n.meta.get("cost", 0.0)), comm_us=lambda n: float(n.meta.get("cost", 0.0))
    )


def _uids(nodes: list[fx.Node], keep: object = None) -> list[str]:
    return [n.meta["uid"] for n in nodes if "uid" in n.meta and (keep is None or keep(n))]  # type: ignore[operator]


@settings(max_examples=60, deadline=None)
@given(forward=_half("f"), backward=_half("b"))
def test_reordering_never_violates_a_dependency(forward: fx.GraphModule, backward: fx.GraphModule) -> None:
    merged = multiplex(forward, backward, costs=_meta_costs())
    order = [n for n in merged.graph.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(merged.graph.graph.nodes)}
    for node in order:  # every input is computed before its user
        assert all(position[i] < position[node] for i in node.all_input_nodes)
    originals = [n for gm in (forward, backward) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert sorted(_uids(order)) == sorted(_uids(originals))  # every node once
    ordered = lambda n: is_collective(n) or is_wait(n) or "rand" in str(n.target)  # noqa: E731
    for prefix, gm in (("f", forward), ("b", backward)):
        mine = [n for n in order if n.meta["uid"].startswith(prefix)]
        assert _uids(mine, ordered) == _uids(list(gm.graph.nodes), ordered)
    # the collectives' order does not depend on the costs (ranks may estimate differently)
    halves = [n.meta[HALF_KEY] for n in order if is_collective(n)]
    other = multiplex(forward, backward, costs=CostModel(compute_us=lambda n: 1.0, comm_us=lambda n: 1000.0))
    assert _uids([n for n in other.graph.graph.nodes if is_collective(n)]) == _uids(
        [n for n in order if is_collective(n)]
    )
    report = merged.report
    assert len(report.comms) == len(halves)
    assert all(0 <= c.hidden_fraction <= 1 and 0 <= c.hideable_fraction <= 1 for c in report.comms)
    assert report.multiplexed.makespan_us >= report.multiplexed.compute_us - 1e-6
    assert abs(report.multiplexed.compute_us - report.sequential.compute_us) < 1e-6 * (1 + report.sequential.compute_us)


def test_without_overlap_the_merged_graph_runs_f_then_b_and_inputs_are_untouched() -> None:
    def forward(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (_c10d.wait_tensor.default(_c10d.all_to_all_single.default(_aten.relu.default(x), [1, 1], [1, 1], "0")),)

    def backward(g: torch.Tensor) -> tuple[torch.Tensor]:
        return (_aten.exp.default(_aten.relu.default(g)),)

    fw, bw = fx.symbolic_trace(forward), fx.symbolic_trace(backward)
    before = [str(n.target) for n in fw.graph.nodes], [str(n.target) for n in bw.graph.nodes]
    flat = multiplex(fw, bw, costs=roofline_costs(), overlap=False)
    targets = [str(n.target) for n in flat.graph.graph.nodes if n.op == "call_function"]
    assert targets == [str(n.target) for gm in (fw, bw) for n in gm.graph.nodes if n.op == "call_function"]
    mixed = multiplex(fw, bw, costs=CostModel(compute_us=lambda n: 10.0, comm_us=lambda n: 100.0))
    halves = [n.meta[HALF_KEY] for n in mixed.graph.graph.nodes if n.op == "call_function"]
    assert halves == ["forward", "forward", "backward", "backward", "forward"]  # B's compute runs in flight
    assert ([str(n.target) for n in fw.graph.nodes], [str(n.target) for n in bw.graph.nodes]) == before
    assert mixed.report.comms[0].compute_between_us == 20.0 and mixed.report.comms[0].exposed_us == 80.0
    sim = simulate(
        [n for n in fw.graph.nodes if n.op == "call_function"],
        CostModel(compute_us=lambda n: 10.0, comm_us=lambda n: 100.0),
    )
    assert sim.makespan_us == 110.0 and sim.exposed_comm_us == 100.0


def _record_shapes(gm: fx.GraphModule, args: list[torch.Tensor]) -> None:
    """Record ``meta["val"]`` on every node by running on meta tensors, collectives as identities."""

    class Shapes(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            result = self.env[n.all_input_nodes[0]] if is_collective(n) or is_wait(n) else super().run_node(n)
            n.meta["val"] = result
            return result

    Shapes(gm).run(*args)


def test_profile_costs_sum_to_the_profile_and_price_links() -> None:
    def forward(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
        y = _aten.mm.default(x, w)
        return (_c10d.wait_tensor.default(_c10d.all_to_all_single.default(y, [4, 4], [4, 4], "0")),)

    def backward(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor]:
        return (_aten.mm.default(g, _aten.t.default(w)),)

    fw, bw = fx.symbolic_trace(forward), fx.symbolic_trace(backward)
    shapes = {"w": (16, 16), "x": (8, 16), "g": (8, 16)}
    for gm in (fw, bw):
        _record_shapes(
            gm, [torch.empty(shapes[n.name], device="meta") for n in gm.graph.nodes if n.op == "placeholder"]
        )
    profile = profile_pb2.Profile(
        layers=[
            profile_pb2.LayerCost(
                layer_name="a",
                forward_duration_us=300.0,
                backward_input_duration_us=200.0,
                backward_weight_duration_us=100.0,
            ),
            profile_pb2.LayerCost(
                layer_name="b",
                forward_duration_us=100.0,
                backward_input_duration_us=20.0,
                backward_weight_duration_us=10.0,
                full_backward_duration_us=25.0,
            ),
        ],
        links=[
            profile_pb2.LinkCost(source_rank=0, destination_rank=1, latency_us=50.0, bandwidth_bytes_per_second=1e9)
        ],
    )
    costs = profile_costs(profile, forward=fw, backward=bw, forward_layers=["a", "b"], backward_layers=["a", "b"])
    body = [n for n in fw.graph.nodes if n.op == "call_function"]
    assert abs(sum(costs.compute_us(n) for n in body) - 400.0) < 1e-6
    assert abs(sum(costs.compute_us(n) for n in bw.graph.nodes if n.op == "call_function") - 325.0) < 1e-6
    issue = next(n for n in body if is_collective(n))
    assert comm_bytes(issue) == 8 * 16 * 4 // 2  # half of the buffer leaves the rank
    assert abs(costs.comm_us(issue) - (50.0 + 256 / 1e3)) < 1e-9
    with pytest.raises(ValueError, match="no costs for layers"):
        profile_costs(profile, forward=fw, backward=bw, forward_layers=["c"], backward_layers=[])
    with pytest.raises(ValueError, match="no links"):
        profile_costs(
            profile_pb2.Profile(layers=profile.layers),
            forward=fw,
            backward=bw,
            forward_layers=["a"],
            backward_layers=["a"],
        )


def test_measure_compute_us_times_every_compute_node_on_the_devices_clock() -> None:
    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sum()

    graph = fx.symbolic_trace(body)
    times = measure_compute_us(graph, [torch.randn(64, 64), torch.randn(64, 64)], repeats=3)
    computed = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
    assert set(times) == set(computed) and len(computed) == 3  # matmul, relu, sum: each timed, nothing else
    assert all(t > 0 for t in times.values())
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure_compute_us(graph, [torch.randn(2, 2), torch.randn(2, 2)], repeats=0)
