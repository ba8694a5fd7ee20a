"""Expert parallelism on 2 gloo ranks: the EP MoE decoder equals the unsharded one (outputs and gradients).

Each rank routes its own batch. The reference is the unsharded model run in
every process on both ranks' batches: a rank's loss and replicated-parameter
gradients are those of its own batch; its expert gradients are the sum over
both batches, restricted to the experts it holds. The captured EP stages
(collectives traced into the graphs) reproduce the eager EP model bitwise.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from octopipe.examples.models import ExpertParallelMoE, ModelConfig, MoE, expert_parallel, moe_decoder
from tests.pipeline_reference import assert_same, eager_reference, run_split
from tests.transform.gloo import default_group, run_ranks

SEQ = 8


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _ep_matches_unsharded(rank: int, world: int) -> None:
    config = ModelConfig.tiny()
    torch.manual_seed(0)
    reference = moe_decoder(2, config)
    sharded = expert_parallel(copy.deepcopy(reference), default_group())
    assert sum(isinstance(m, ExpertParallelMoE) for m in sharded.modules()) == 2
    batches = [_batch(config.vocab, seed=100 + r) for r in range(world)]
    per_rank = [eager_reference(reference, functools.partial(reference, *b), seed=0) for b in batches]
    tokens, targets = batches[rank]
    loss, grads = eager_reference(sharded, lambda: sharded(tokens, targets), seed=0)

    ref_loss, ref_grads = per_rank[rank]
    torch.testing.assert_close(loss, ref_loss)
    local = config.experts // world
    for name, grad in grads.items():
        if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
            expected = torch.stack([g[name] for _, g in per_rank]).sum(0)[rank * local : (rank + 1) * local]
            assert grad.shape[0] == local
        else:
            expected = ref_grads[name]
        torch.testing.assert_close(grad, expected, msg=lambda m, n=name: f"{n}: {m}")  # type: ignore[misc]

    # captured stages run the all-to-alls inside their graphs: bitwise the eager EP model
    result = run_split(sharded, [sharded.pipeline_layers()], tokens, targets, seed=0)
    assert torch.equal(result.loss, loss)
    assert_same(grads, result.grads, bitwise=True)
    graph_ops = [str(n.target) for exe in result.stages for n in exe.graphs.forward.graph.nodes]
    assert graph_ops.count("_c10d_functional.all_to_all_single.default") == 4  # dispatch + combine, 2 layers
    assert graph_ops.count("_c10d_functional.wait_tensor.default") == 4

    with pytest.raises(ValueError, match="multiple of the group size"):
        ExpertParallelMoE(MoE(8, 8, experts=3, top_k=1), default_group())
    with pytest.raises(ValueError, match="no MoE layer"):
        expert_parallel(torch.nn.Linear(2, 2), default_group())


def test_expert_parallel_moe_matches_unsharded_on_two_ranks() -> None:
    run_ranks(_ep_matches_unsharded, 2)
