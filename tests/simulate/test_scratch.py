"""Scratch memory: what an action allocates and frees before it ends is held for its duration (issue 15)."""

from __future__ import annotations

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Link, StageCost, simulate
from octopipe.tune import gpipe, one_f_one_b, zb_h1


def test_scratch_is_held_during_its_action_and_adds_to_the_peak() -> None:
    plan = gpipe(2, 2)
    stage = StageCost(forward_us=1.0, backward_input_us=1.0, backward_weight_us=1.0, activation_bytes=100)
    base = simulate(plan, CostModel.uniform(num_stages=2, stage=stage, link=Link())).estimate
    # GPipe: both forwards' activations (200) are held when the second forward runs
    assert [r.peak_memory_bytes for r in base.ranks] == [200, 200]
    scratch = StageCost(
        forward_us=1.0, backward_input_us=1.0, backward_weight_us=1.0, activation_bytes=100, forward_scratch_bytes=1000
    )
    got = simulate(plan, CostModel.uniform(num_stages=2, stage=scratch, link=Link())).estimate
    # during the second forward: 100 held + its own 100 + 1000 scratch; times do not change
    assert [r.peak_memory_bytes for r in got.ranks] == [1200, 1200]
    assert [r.peak_activation_bytes for r in got.ranks] == [200, 200]
    assert got.step_time_us == base.step_time_us
    # a backward's scratch is held while its micro-batch's activations still are (1F1B, one in flight at the end)
    backward = StageCost(forward_us=1.0, full_backward_us=1.0, activation_bytes=100, full_backward_scratch_bytes=50)
    one = simulate(one_f_one_b(2, 1), CostModel.uniform(num_stages=2, stage=backward, link=Link())).estimate
    assert [r.peak_memory_bytes for r in one.ranks] == [150, 150]


def test_scratch_comes_from_the_profile_as_the_most_of_a_stage_layers() -> None:
    layers = [
        profile_pb2.LayerCost(layer_name=f"l{i}", forward_duration_us=1.0, forward_scratch_bytes=scratch)
        for i, scratch in enumerate([10, 70, 30, 5])
    ]
    profile = profile_pb2.Profile(layers=layers)
    plan = gpipe(2, 1, layer_names=[["l0", "l1"], ["l2", "l3"]])
    costs = CostModel.from_profile(plan, profile, default_link=Link())
    assert [s.forward_scratch_bytes for s in costs.stages] == [70, 30]


def test_a_stage_weight_gradient_scratch_holds_every_layer_gradient_at_once() -> None:
    """W returns all of a stage's parameter gradients together (then they are added in), made from the last
    layer to the first: the most over layers of the later layers' gradients plus the layer's own scratch."""
    layers = [
        profile_pb2.LayerCost(
            layer_name=f"l{i}", forward_duration_us=1.0, gradient_bytes=grads, backward_weight_scratch_bytes=scratch
        )
        for i, (grads, scratch) in enumerate([(100, 130), (300, 310), (50, 90)])
    ]
    profile = profile_pb2.Profile(layers=layers)
    plan = gpipe(1, 1, layer_names=[["l0", "l1", "l2"]])
    (stage,) = CostModel.from_profile(plan, profile, default_link=Link()).stages
    # l2: 90; l1: 50 + 310; l0: 50 + 300 + 130
    assert stage.backward_weight_scratch_bytes == 50 + 300 + 130
    assert stage.full_backward_scratch_bytes == 0  # not measured


def test_the_first_weight_gradient_of_a_stage_makes_the_accumulated_gradients() -> None:
    """The static bytes hold the gradients all step; the first W's output is them, later W's make a second copy."""
    stage = StageCost(
        forward_us=1.0,
        backward_input_us=1.0,
        backward_weight_us=1.0,
        activation_bytes=0,
        gradient_bytes=1000,
        backward_weight_scratch_bytes=1000 + 30,
    )
    one = simulate(zb_h1(2, 1), CostModel.uniform(num_stages=2, stage=stage, link=Link())).estimate
    assert [r.peak_memory_bytes for r in one.ranks] == [1000 + 30, 1000 + 30]
    two = simulate(zb_h1(2, 2), CostModel.uniform(num_stages=2, stage=stage, link=Link())).estimate
    assert [r.peak_memory_bytes for r in two.ranks] == [2000 + 30, 2000 + 30]


def test_what_input_gradient_keeps_for_weight_gradient_is_held_until_w() -> None:
    """I allocates output gradients W needs (beyond F's activations): held from I's start until W ends."""
    stage = StageCost(
        forward_us=1.0,
        backward_input_us=1.0,
        backward_weight_us=1.0,
        activation_bytes=100,
        freed_by_backward_input_bytes=60,
        kept_for_weight_bytes=50,
    )
    estimate = simulate(zb_h1(2, 1), CostModel.uniform(num_stages=2, stage=stage, link=Link())).estimate
    # F: 100; I: + 50 while it runs, then - 60; W: frees the other 40 and the 50
    assert [r.peak_memory_bytes for r in estimate.ranks] == [150, 150]
    fused = simulate(one_f_one_b(2, 1), CostModel.uniform(num_stages=2, stage=stage, link=Link())).estimate
    assert [r.peak_memory_bytes for r in fused.ranks] == [100, 100]  # a fused backward keeps nothing for later


def test_a_stage_whose_input_needs_no_gradient_has_nothing_for_i_to_do() -> None:
    """The model's data needs no gradient: the first stage's I computes nothing; W back-propagates instead."""
    layers = [
        profile_pb2.LayerCost(
            layer_name=f"l{i}",
            forward_duration_us=1.0,
            backward_input_duration_us=2.0,
            backward_weight_duration_us=3.0,
            activation_saved_bytes=100,
            activation_freed_by_backward_input_bytes=60,
            backward_input_kept_bytes=30,
            backward_input_scratch_bytes=7,
            backward_weight_scratch_bytes=5,
            full_backward_scratch_bytes=40,
            input_without_gradient=i == 0,
        )
        for i in range(4)
    ]
    plan = zb_h1(2, 1, layer_names=[["l0", "l1"], ["l2", "l3"]])
    first, second = CostModel.from_profile(plan, profile_pb2.Profile(layers=layers), default_link=Link()).stages
    assert (first.backward_input_us, first.backward_weight_us) == (0.0, 10.0)
    assert (first.freed_by_backward_input_bytes, first.kept_for_weight_bytes, first.backward_input_scratch_bytes) == (
        0,
        0,
        0,
    )
    assert (second.backward_input_us, second.backward_weight_us) == (4.0, 6.0)
    assert (second.freed_by_backward_input_bytes, second.kept_for_weight_bytes) == (120, 60)
    # the first stage's W is its whole backward, so its scratch is the full backward's (the allocator agrees:
    # bench/recompute_memory.py, ZB-H1 rank 0); the others' W keeps its own
    assert (first.backward_weight_scratch_bytes, first.full_backward_scratch_bytes) == (40, 40)
    assert (second.backward_weight_scratch_bytes, second.full_backward_scratch_bytes) == (5, 40)


def test_a_layer_scratch_rides_on_what_the_stage_made_before_it() -> None:
    """F runs layers first to last, each saving its activations: an early layer's scratch (150 at its peak)
    stays under what the stage holds at the end (200); the last layer's 10 rides on all of it."""
    layers = [
        profile_pb2.LayerCost(
            layer_name=f"l{i}",
            forward_duration_us=1.0,
            activation_saved_bytes=100,
            forward_scratch_bytes=scratch,
            backward_input_kept_bytes=kept,
            backward_input_scratch_bytes=input_scratch,
        )
        for i, (scratch, kept, input_scratch) in enumerate([(50, 40, 5), (10, 40, 60)])
    ]
    plan = gpipe(1, 1, layer_names=[["l0", "l1"]])
    (stage,) = CostModel.from_profile(plan, profile_pb2.Profile(layers=layers), default_link=Link()).stages
    assert stage.forward_scratch_bytes == 10  # max(100 + 50, 200 + 10) - 200
    assert stage.backward_input_scratch_bytes == 20  # I goes last to first: max(40 + 60, 80 + 5) - 80
