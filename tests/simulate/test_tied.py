"""Tied parameters in the simulator: the step's closing exchange and the gradients kept per micro-batch.

The runtime (``octopipe.execute.runtime.whole_model.reduce_tied``) keeps each holder's gradient of a
tied parameter per micro-batch and, after every rank's last action, every rank joins one broadcast
of m x size per holding stage. Hand counts below.
"""

from __future__ import annotations

import dataclasses

import pytest

from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Link, StageCost, TiedExchange, simulate, tied_exchanges
from octopipe.tune import one_f_one_b, zb_h1

M, SIZE = 4, 1000
LINK = Link(latency_us=10.0, bandwidth_bytes_per_second=1e9)


def costs(tied: tuple[TiedExchange, ...]) -> CostModel:
    stage = StageCost(forward_us=100.0, backward_input_us=100.0, backward_weight_us=50.0, parameter_bytes=SIZE)
    return dataclasses.replace(CostModel.uniform(num_stages=2, stage=stage, link=LINK), tied=tied)


@pytest.mark.parametrize("schedule", [one_f_one_b, zb_h1])
def test_the_exchange_closes_the_step_and_its_buffers_top_the_peak(schedule: object) -> None:
    plan: plan_pb2.Plan = schedule(2, M)  # type: ignore[operator]
    tie = TiedExchange(name="embed.weight", size_bytes=SIZE, stages=(0, 1))
    plain, tied = (simulate(plan, costs(t)).estimate for t in ((), (tie,)))
    # two broadcasts (one per holding stage) of m x size: latency + bytes / bandwidth each
    assert tied.step_time_us == pytest.approx(plain.step_time_us + 2 * (10.0 + M * SIZE / 1e9 * 1e6))
    for before, after in zip(plain.ranks, tied.ranks, strict=True):
        # no activations here: the peak is the end of the step, where each holder keeps m - 1 more
        # per-micro-batch gradients and every rank the two broadcasts' m x size buffers
        assert before.peak_memory_bytes == before.static_memory_bytes
        assert after.peak_memory_bytes == before.static_memory_bytes + (M - 1) * SIZE + 2 * M * SIZE


def test_a_tie_inside_one_stage_is_an_ordinary_parameter() -> None:
    tied = [profile_pb2.TiedParameter(name="embed.weight", size_bytes=SIZE, layer_names=["embed", "head"])]
    assert tied_exchanges(tied, [["embed", "a"], ["b", "head"]]) == (
        TiedExchange(name="embed.weight", size_bytes=SIZE, stages=(0, 1)),
    )
    assert tied_exchanges(tied, [["embed", "a", "b", "head"]]) == ()
    with pytest.raises(ValueError, match="two or more distinct stages"):
        TiedExchange(name="w", size_bytes=SIZE, stages=(1,))
