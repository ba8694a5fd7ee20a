"""The FSDP collective split: UNSHARD + F + B + W + REDUCE_GRAD reproduce FSDP2 (``fully_shard``) on 2 gloo ranks.

Two patterns: plain fp32 dim-0 sharding with padding (an FFN of 45 rows over
2 ranks), and FSDP2-style mixed precision (bf16 gather and compute, fp32
gradient reduction) with flat (FSDP1-style) shards of parameters whose
element count is odd. Two micro-batches run F, B and W; their full gradients
are summed and reduced once (REDUCE_GRAD once per step), against FSDP2
accumulating over the same two micro-batches. The structural tests below
need no process group: they split hand-built graphs.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from octopipe.capture import StageGraphs, capture_stage, split_model
from octopipe.examples.models import DecoderLM, ModelConfig, llama
from octopipe.transform import (
    BucketPolicy,
    ShardConfig,
    bucket_collectives,
    compile_fsdp_stage,
    count_collectives,
    shard_parameters,
    split_fsdp,
    unshard_tensor,
)
from tests.transform.gloo import default_group, run_ranks

CASES = {
    "fp32-dim0": (lambda: llama(2, ModelConfig.tiny(ffn=45)), ShardConfig()),
    "bf16-flat": (
        lambda: DecoderLM([("none", "swiglu")] * 2, ModelConfig.tiny(hidden=33, ffn=45)),
        ShardConfig(layout="flat", param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    ),
}


def _check_case(rank: int, world: int, case: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    build, config = CASES[case]
    torch.manual_seed(0)
    reference_model = build()
    model = copy.deepcopy(reference_model)
    names = model.pipeline_layers()
    partition = [names[:1], names[1:-1], names[-1:]]
    reference = split_model(reference_model, partition)[1]
    stage = split_model(model, partition)[1]
    hidden = model.config.hidden
    generator = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(2, 8, hidden, generator=generator), torch.randn(2, 8, hidden, generator=generator))]
    batches.append((torch.randn(2, 8, hidden, generator=generator), torch.randn(2, 8, hidden, generator=generator)))
    dtype = config.param_dtype or torch.float32

    # FSDP2 eager: every layer and the stage fully_shard-ed, gradients accumulated over both micro-batches
    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in reference_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(reference, mesh=mesh, mp_policy=policy)
    expected_out, expected_in = [], []
    for x, g in batches:
        x = x.clone().requires_grad_()
        y = reference(x)
        y.backward(g.to(y.dtype))
        expected_out.append(y.detach())
        assert x.grad is not None
        expected_in.append(x.grad)

    specs = shard_parameters(stage, default_group(), config=config)
    fsdp_params = dict(reference.named_parameters())
    for name, shard in stage.named_parameters():  # our shards hold FSDP2's local shards (plus padding)
        local = fsdp_params[name].to_local()  # type: ignore[attr-defined]
        if config.layout == "dim0":
            assert torch.equal(shard[: local.shape[0]], local)
    fsdp = compile_fsdp_stage(stage, [batches[0][0].to(dtype)], stage_index=1)
    chains = {c.name: c for c in fsdp.graphs.chains}
    assert all(c.unshard_ops and c.reduce_ops for c in chains.values())
    ops = {op for c in chains.values() for op in (*c.unshard_ops, *c.reduce_ops)}
    if case == "bf16-flat":
        assert "_to_copy" in ops and "view" in ops and "constant_pad_nd" in ops
    else:
        assert "slice.Tensor" in ops and "constant_pad_nd" in ops
    assert not any("_c10d" in str(n.target) for n in fsdp.graphs.stage.forward.graph.nodes)
    assert not any("_c10d" in str(n.target) for n in fsdp.graphs.stage.backward.graph.nodes)

    executable = fsdp.unshard()  # UNSHARD
    accumulated: list[torch.Tensor | None] = [None] * len(fsdp.shards)
    for (x, g), out_ref, in_ref in zip(batches, expected_out, expected_in, strict=True):
        out, ctx = executable.forward([x.to(dtype)])  # F
        input_grads, wctx = executable.backward_input(ctx, g.to(dtype))  # B
        full = executable.backward_weight(wctx)  # W: full gradients, in the reduce dtype
        accumulated = [a if f is None else f if a is None else a + f for a, f in zip(accumulated, full, strict=True)]
        assert torch.equal(out, out_ref)
        torch.testing.assert_close(input_grads[0], in_ref.to(dtype))
    shard_grads = fsdp.reduce_grad(accumulated)  # REDUCE_GRAD, once per step
    for name, shard_grad in zip(fsdp.graphs.stage.param_names, shard_grads, strict=True):
        assert shard_grad is not None
        full_grad = unshard_tensor(shard_grad, specs[name])
        expected = fsdp_params[name].grad
        assert expected is not None
        expected_full = expected.full_tensor()  # type: ignore[attr-defined]
        torch.testing.assert_close(full_grad, expected_full, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]


class _CountCollectives(TorchDispatchMode):
    """Counts the functional collectives issued under it, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket.__name__)
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _check_buckets(rank: int, world: int, case: str) -> None:
    """Bucketed UNSHARD / REDUCE_GRAD issue one collective per bucket and equal the per-parameter ones bitwise."""
    build, config = CASES[case]
    torch.manual_seed(0)
    model = build()
    names = model.pipeline_layers()
    stage = split_model(model, [names[:1], names[1:-1], names[-1:]])[1]
    shard_parameters(stage, default_group(), config=config)
    dtype = config.param_dtype or torch.float32
    x = torch.randn(2, 8, model.config.hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    plain = split_fsdp(capture_stage(stage, [x], stage_index=1))  # one collective per parameter
    shards = [dict(stage.named_parameters())[n] for n in plain.stage.param_names]
    params = len(shards)
    assert count_collectives(plain.unshard) == {"all_gather": params, "reduce_scatter": 0}
    assert count_collectives(plain.reduce_grad) == {"all_gather": 0, "reduce_scatter": params}
    shard_bytes = sum(s.numel() * dtype.itemsize for s in shards)
    for policy, buckets in [(BucketPolicy(), 1), (BucketPolicy(bucket_bytes=shard_bytes // 2), None)]:
        bucketed = bucket_collectives(plain, policy)
        expected = [*plain.unshard(*shards)]
        with _CountCollectives() as counter:
            got = [*bucketed.unshard(*shards)]
        gathers = count_collectives(bucketed.unshard)["all_gather"]
        assert counter.counts == {"all_gather_into_tensor": gathers}  # what ran is what the graph holds
        assert gathers == buckets if buckets is not None else 1 < gathers < params
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(got, expected, strict=True))
        generator = torch.Generator().manual_seed(20 + rank)
        grads = [torch.randn(p.shape, generator=generator, dtype=config.reduce_dtype or p.dtype) for p in expected]
        expected_grads = [*plain.reduce_grad(*grads)]
        with _CountCollectives() as counter:
            got_grads = [*bucketed.reduce_grad(*grads)]
        scatters = count_collectives(bucketed.reduce_grad)["reduce_scatter"]
        assert counter.counts == {"reduce_scatter_tensor": scatters}
        assert scatters == buckets if buckets is not None else 1 < scatters <= params
        # two ranks: every element is the same sum of two values, so bitwise
        assert all(torch.equal(a, b) for a, b in zip(got_grads, expected_grads, strict=True))


def _both_cases(rank: int, world: int) -> None:
    for case in CASES:
        _check_case(rank, world, case)
        _check_buckets(rank, world, case)


def test_unshard_f_b_w_reduce_grad_match_fully_shard_on_two_ranks_and_bucketing_changes_no_bit() -> None:
    run_ranks(_both_cases, 2)


# ---- structure, on hand-built graphs (no process group needed) ----

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


def _stage(forward: fx.GraphModule, backward: fx.GraphModule, params: int) -> StageGraphs:
    return StageGraphs(
        forward=forward,
        backward=backward,
        param_names=tuple(f"p{i}" for i in range(params)),
        buffer_names=(),
        num_inputs=1,
        num_outputs=1,
        num_saved=1,
        input_requires_grad=(True,),
        route="direct",
        recompute_regions=0,
        pruned_nodes=(),
    )


def _gather(shard: torch.Tensor) -> torch.Tensor:
    cast = _aten._to_copy.default(shard, dtype=torch.bfloat16)
    full = _c10d.wait_tensor.default(_c10d.all_gather_into_tensor.default(cast, 2, "0"))
    return _aten.view.default(_aten.slice.Tensor(full, 0, 0, 15), [3, 5])


def _scatter(grad: torch.Tensor) -> torch.Tensor:
    flat = _aten.view.default(_aten._to_copy.default(grad, dtype=torch.float32), [-1])
    padded = _aten.mul.Scalar(_aten.constant_pad_nd.default(flat, [0, 1]), 0.5)
    return _c10d.wait_tensor.default(_c10d.reduce_scatter_tensor.default(padded, "sum", 2, "0"))


def _simple_forward(p0: torch.Tensor, p1: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w = _gather(p0)
    y = _aten.mm.default(x, _aten.t.default(w))
    return _aten.mul.Tensor(y, p1), w


def _simple_backward(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    dw = _aten.mm.default(_aten.t.default(g), w)
    return _scatter(dw), None, _aten.mm.default(g, w)


def test_split_moves_cast_gather_unpad_view_and_pad_scale_scatter_and_is_pure() -> None:
    graphs = _stage(fx.symbolic_trace(_simple_forward), fx.symbolic_trace(_simple_backward), params=2)
    before = [len(graphs.forward.graph.nodes), len(graphs.backward.graph.nodes)]
    split = split_fsdp(graphs)
    assert [len(graphs.forward.graph.nodes), len(graphs.backward.graph.nodes)] == before
    first, second = split.chains
    assert first.unshard_ops == ("_to_copy", "all_gather_into_tensor", "wait_tensor", "slice.Tensor", "view")
    assert first.reduce_ops == ("view", "constant_pad_nd", "mul.Scalar", "reduce_scatter_tensor", "wait_tensor")
    assert second.unshard_ops == second.reduce_ops == ()  # p1 is not sharded: it passes through
    # the cast to the reduce dtype stays in W: REDUCE_GRAD's input is the full fp32 gradient
    entry = next(n for n in split.reduce_grad.graph.nodes if n.op == "placeholder")
    assert [str(u.target) for u in entry.users] == ["aten.view.default"]
    unshard_out = next(n for n in split.unshard.graph.nodes if n.op == "output").args[0]
    assert [str(getattr(n, "target", "")) for n in unshard_out] == ["aten.view.default", "p1"]
    for gm in (split.stage.forward, split.stage.backward):
        assert not any(str(n.target).startswith("_c10d") for n in gm.graph.nodes)


def _twice_forward(p0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _aten.add.Tensor(_aten.mm.default(x, _gather(p0)), _aten.sum.default(_gather(p0))), x


def _direct_forward(p0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cast = _aten._to_copy.default(p0, dtype=torch.bfloat16)
    full = _c10d.wait_tensor.default(_c10d.all_gather_into_tensor.default(cast, 2, "0"))
    return _aten.add.Tensor(_aten.mm.default(x, full), _aten.sum.default(cast)), x


def _plain_forward(p0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _aten.mm.default(x, _gather(p0)), x


def _identity_backward(saved: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return None, g


def _combined_backward(saved: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return _aten.add.Tensor(_scatter(g), saved), g


def _regather_backward(saved: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return None, _aten.mm.default(g, _gather(saved))


def _coalesced_backward(saved: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    out = _c10d.all_reduce.default(g, "sum", "0")
    return None, _c10d.wait_tensor.default(out)


@pytest.mark.parametrize(
    ("forward", "backward", "message"),
    [
        (_twice_forward, _identity_backward, "all-gathered 2 times"),
        (_direct_forward, _identity_backward, "used by compute directly"),
        (_plain_forward, _combined_backward, "combined"),
        (_plain_forward, _regather_backward, "all-gathers parameters again"),
        (_plain_forward, _coalesced_backward, "all_reduce"),
    ],
    ids=["gathered-twice", "shard-used-directly", "reduced-then-combined", "backward-regathers", "all-reduce"],
)
def test_patterns_not_handled_are_refused_with_the_parameter_named(
    forward: object, backward: object, message: str
) -> None:
    graphs = _stage(fx.symbolic_trace(forward), fx.symbolic_trace(backward), params=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        split_fsdp(graphs)


def test_getitem_of_split_counts_as_layout() -> None:
    from octopipe.transform.collectives import is_layout

    graph = fx.Graph()
    x = graph.placeholder("x")
    parts = graph.call_function(_aten.split.Tensor, (x, 2))
    item = graph.call_function(operator.getitem, (parts, 0))
    assert is_layout(parts) and is_layout(item)


def _exclude_keeps_parameters_whole(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = llama(1, ModelConfig.tiny())
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = "layers.0.ffn.w1.weight"
    with pytest.raises(ValueError, match="does not have"):
        shard_parameters(copy.deepcopy(model), default_group(), exclude=["layers.0.ffn.nope"])
    specs = shard_parameters(model, default_group(), exclude=[kept])
    assert kept not in specs and len(specs) == len(full) - 1
    params = dict(model.named_parameters())
    assert torch.equal(params[kept], full[kept])  # whole and local
    other = "layers.0.ffn.w2.weight"
    assert params[other].shape[0] == -(-full[other].shape[0] // world)  # sharded
    assert torch.equal(model.get_parameter(kept), full[kept])  # the attribute is the local Parameter
    assert torch.equal(unshard_tensor(params[other], specs[other]), full[other])


def test_shard_parameters_leaves_excluded_parameters_whole() -> None:
    run_ranks(_exclude_keeps_parameters_whole, 2)
