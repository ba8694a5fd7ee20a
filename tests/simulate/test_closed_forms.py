"""Uniform costs, no communication: the simulator reproduces the closed forms of shared/facts.md exactly.

facts.md (p ranks, m micro-batches, v chunks per rank; per-stage F, B (input
gradient), W (weight gradient), B_full = B + W; a = one stage's activations
for one micro-batch):

| schedule | bubble per rank | peak activations |
| GPipe | (p-1)(F+B_full) | m·a |
| 1F1B | (p-1)(F+B_full) | rank r: min(p-r, m)·a |
| interleaved 1F1B (chunk time /v) | (p-1)(F+B_full)/v | rank 0: (p + (p-1)/v)·a |
| ZB-H1 | (p-1)(F+B-W) | ≤ 1F1B |

The bubble per rank is step time - busy time, so step time = m·(F+B_full) + bubble.
All costs are small integers, so every float here is exact and compared with ==.
"""

from __future__ import annotations

import itertools

import pytest

from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import Estimate, simulate, uniform_profile
from octopipe.tune import gpipe, interleaved_1f1b, one_f_one_b, zb_h1

GRID = [(p, k * p) for p, k in itertools.product([2, 4, 8], [1, 2, 4, 8])]
# (F, B, W) per stage. facts.md's ZB-H1 form needs W <= min(F, B) (see test_zb_h1_when_w_is_long).
COSTS = [(1, 1, 1), (1, 2, 1), (2, 3, 1), (3, 2, 2)]
ACTIVATION = 4  # bytes of one stage (or one chunk) for one micro-batch
HALF = 2  # what I frees of them in ZB-H1; W frees the rest


def names(num_stages: int) -> list[list[str]]:
    return [[f"layer{s}"] for s in range(num_stages)]


def run(plan: plan_pb2.Plan, f: int, b: int, w: int, *, freed_by_input: int = 0) -> Estimate:
    profile = uniform_profile(
        plan,
        forward_us=f,
        backward_input_us=b,
        backward_weight_us=w,
        activation_bytes=ACTIVATION,
        freed_by_backward_input_bytes=freed_by_input,
    )
    return simulate(plan, profile).estimate


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b(schedule: str, p: int, m: int) -> None:
    plan = (gpipe if schedule == "gpipe" else one_f_one_b)(p, m, layer_names=names(p))
    for f, b, w in COSTS:
        estimate = run(plan, f, b, w)
        bubble = (p - 1) * (f + b + w)
        assert estimate.step_time_us == m * (f + b + w) + bubble
        for rank in estimate.ranks:
            assert rank.busy_us == m * (f + b + w)
            assert rank.idle_us == bubble
            held = m if schedule == "gpipe" else min(p - rank.rank, m)
            assert rank.peak_activation_bytes == held * ACTIVATION
            assert rank.peak_memory_bytes == held * ACTIVATION  # nothing else is held here
        assert estimate.bubble_ratio == bubble / (m * (f + b + w) + bubble)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaved_1f1b(p: int, v: int, m: int) -> None:
    """Each chunk costs f, b, w, so a rank's stage costs F = v·f etc. and a = v·ACTIVATION."""
    plan = interleaved_1f1b(p, v, m, layer_names=names(p * v))
    for f, b, w in COSTS:
        estimate = run(plan, f, b, w)
        per_stage = v * (f + b + w)  # F + B_full of a whole rank's share of the model
        bubble = (p - 1) * per_stage // v
        assert estimate.step_time_us == m * per_stage + bubble
        assert {rank.idle_us for rank in estimate.ranks} == {bubble}
        a = v * ACTIVATION
        # rank 0: (p + (p-1)/v)·a, i.e. v·p + p - 1 chunks; with m = p it cannot hold more than all m·v chunks.
        assert estimate.ranks[0].peak_activation_bytes == min((p + (p - 1) / v) * a, m * a)
        for rank in estimate.ranks:  # every rank: its warm-up forwards plus one, in chunks
            warmup = (v - 1) * p + 2 * (p - 1 - rank.rank)
            assert rank.peak_activation_bytes == min(warmup + 1, m * v) * ACTIVATION


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1(p: int, m: int) -> None:
    plan = zb_h1(p, m, layer_names=names(p))
    one_f_one_b_peak = min(p, m) * ACTIVATION  # 1F1B's peak (rank 0)
    for f, b, w in COSTS:
        assert w <= min(f, b)
        estimate = run(plan, f, b, w, freed_by_input=HALF)
        bubble = (p - 1) * (f + b - w)
        assert estimate.step_time_us == m * (f + b + w) + bubble
        assert {rank.idle_us for rank in estimate.ranks} == {bubble}
        for rank in estimate.ranks:
            assert rank.peak_activation_bytes <= one_f_one_b_peak
            # Rank r defers r W's: it holds p micro-batches, r of them already halved by their I.
            assert rank.peak_activation_bytes == p * ACTIVATION - rank.rank * HALF
    # If I frees nothing, every rank peaks at p micro-batches: 1F1B's peak, on every rank.
    estimate = run(plan, 1, 1, 1, freed_by_input=0)
    assert {rank.peak_activation_bytes for rank in estimate.ranks} == {one_f_one_b_peak}


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize(("f", "b", "w"), [(1, 1, 2), (1, 1, 3), (2, 1, 2), (1, 3, 2), (1, 2, 3)])
def test_zb_h1_when_w_is_long(p: int, f: int, b: int, w: int) -> None:
    """With W > min(F, B), (p-1)(F+B-W) is no longer reachable: each rank idles (p-1)·max(F+B-W, F, B).

    Found with this simulator over the grid, not taken from the paper; still never worse than 1F1B.
    """
    for m in (p, 4 * p):
        plan = zb_h1(p, m, layer_names=names(p))
        estimate = run(plan, f, b, w)
        bubble = (p - 1) * max(f + b - w, f, b)
        assert estimate.step_time_us == m * (f + b + w) + bubble
        assert bubble < (p - 1) * (f + b + w)
