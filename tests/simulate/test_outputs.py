"""The timing, memory and cost models on cases small enough to work out by hand, and every output format."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from octopipe.estimate.v1 import estimate_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    ActionKind,
    CostModel,
    Link,
    OverlapModel,
    SimulationConfig,
    StageCost,
    StageSpec,
    build_plan,
    durations_from_timelines,
    plot_timeline,
    simulate,
    to_chrome_trace,
    uniform_profile,
    write_chrome_trace,
)
from octopipe.tune import gpipe, one_f_one_b


def profile_for_gpipe() -> tuple[plan_pb2.Plan, profile_pb2.Profile]:
    """Two ranks, one micro-batch. F 2 us, B 3 us (I 2 + W 1); a transfer: 1 us + 4 bytes at 1 MB/s = 5 us."""
    plan = gpipe(2, 1, layer_names=[["a"], ["b"]])
    profile = uniform_profile(
        plan,
        forward_us=2,
        backward_input_us=2,
        backward_weight_us=1,
        activation_bytes=100,
        parameter_bytes=10,
        gradient_bytes=10,
        optimizer_state_bytes=20,
        output_bytes=4,
        latency_us=1,
        bandwidth_bytes_per_second=1e6,
        microbatch_size=8,
    )
    return plan, profile


def test_timeline_by_hand() -> None:
    plan, profile = profile_for_gpipe()
    simulation = simulate(plan, profile, config=SimulationConfig(tokens_per_sample=128))
    spans = {(t.rank, t.action): (t.start_us, t.end_us) for t in simulation.timeline()}
    assert spans == {
        (0, "0F0"): (0, 2),
        (0, "0SEND_F0"): (2, 7),  # posted at 2 (after 0F0), the receive was posted at 0
        (1, "1RECV_F0"): (2, 7),
        (1, "1F0"): (7, 9),
        (1, "1B0"): (9, 12),
        (1, "1SEND_B0"): (12, 17),
        (0, "0RECV_B0"): (12, 17),
        (0, "0B0"): (17, 20),
    }
    estimate = simulation.estimate
    assert estimate.step_time_us == 20
    assert [(r.busy_us, r.idle_us, r.bubble_ratio) for r in estimate.ranks] == [(5, 15, 0.75), (5, 15, 0.75)]
    assert estimate.bubble_ratio == 0.75
    assert estimate.samples_per_step == 8
    assert estimate.samples_per_second == 8e6 / 20
    assert estimate.tokens_per_second == 8e6 / 20 * 128
    # Each rank takes part in both transfers (10 us) while computing nothing.
    assert [(r.communication_us, r.hidden_communication_us) for r in estimate.ranks] == [(10, 0), (10, 0)]
    assert estimate.communication_overlap_ratio == 0.0
    assert [(p.rank, p.action) for p in estimate.critical_path] == [
        (0, "0F0"),
        (0, "0SEND_F0"),
        (1, "1F0"),
        (1, "1B0"),
        (1, "1SEND_B0"),
        (0, "0B0"),
    ]


def test_memory_by_hand() -> None:
    """Static 40 per rank; F saves 100; a 4-byte buffer per transfer on each side while it is held."""
    plan, profile = profile_for_gpipe()
    simulation = simulate(plan, profile)
    rank0, rank1 = simulation.estimate.ranks
    # rank 0: F0 (+100 at 0), its send buffer (+4 from 2 to 7) and the RECV_B0 buffer, posted at the start of
    # the program (the channel's first receive), +4 from 0 to 20.
    assert (rank0.static_memory_bytes, rank0.peak_activation_bytes) == (40, 100)
    assert (rank0.peak_memory_bytes, rank0.peak_memory_time_us) == (148, 2)
    # rank 1: the RECV_F0 buffer (+4 from 0 until 1F0 ends at 9) and F0's activations from 7.
    assert (rank1.peak_memory_bytes, rank1.peak_memory_time_us) == (144, 7)
    assert simulation.memory_curve(0) == [(0, 144), (2, 148), (7, 144), (20, 40)]
    assert simulation.memory_curve(1) == [(0, 44), (7, 144), (9, 140), (12, 44), (17, 40)]


def test_hidden_communication() -> None:
    """1F1B with slow links: rank 0 computes F1 while F0 is on the wire."""
    plan = one_f_one_b(2, 4)
    costs = CostModel.uniform(
        num_stages=2, stage=StageCost(forward_us=4, backward_input_us=4, output_bytes=0), link=Link(latency_us=1)
    )
    estimate = simulate(plan, costs).estimate
    assert 0 < estimate.hidden_communication_us <= estimate.communication_us
    assert estimate.communication_overlap_ratio == estimate.hidden_communication_us / estimate.communication_us
    for rank in estimate.ranks:
        assert rank.hidden_communication_us <= rank.communication_us


def test_fsdp_collectives_and_unsharded_memory() -> None:
    plan = build_plan(
        stages=[StageSpec(rank=0)], actions={0: "0UNSHARD 0F0 0B0 0RESHARD 0REDUCE_GRAD".split()}, num_microbatches=1
    )
    stage = StageCost(
        forward_us=2,
        backward_input_us=1,
        backward_weight_us=1,
        parameter_bytes=300,
        unsharded_bytes=1000,
        unshard_us=5,
        reduce_grad_us=3,
        activation_bytes=10,
    )
    simulation = simulate(plan, CostModel(stages=(stage,)))
    spans = [(t.action, t.stream, t.start_us, t.end_us) for t in simulation.timeline()]
    assert spans == [
        ("0UNSHARD", "collective", 0, 5),
        ("0F0", "compute", 5, 7),  # waits for its parameters
        ("0B0", "compute", 7, 9),
        ("0RESHARD", "collective", 9, 9),
        ("0REDUCE_GRAD", "collective", 9, 12),
    ]
    estimate = simulation.estimate
    assert estimate.step_time_us == 12
    assert (estimate.ranks[0].peak_memory_bytes, estimate.ranks[0].peak_memory_time_us) == (1310, 5)
    assert simulation.memory_curve(0) == [(0, 1300), (5, 1310), (9, 300)]


def test_measured_durations_from_timelines() -> None:
    timeline = profile_pb2.RankTimeline(rank=0)
    for start, end, kind in [(0, 3, "F"), (3, 7, "F"), (7, 9, "F"), (9, 14, "B")]:
        record = timeline.records.add(start_us=start, end_us=end, stream="compute")
        record.action.kind = ActionKind(kind).proto
        record.action.stage_index = 1
        record.action.microbatch_index = 0
    durations = durations_from_timelines([timeline])
    assert durations == {(1, ActionKind.FORWARD): 3.0, (1, ActionKind.FULL_BACKWARD): 5.0}
    plan = gpipe(2, 2)
    model = CostModel.uniform(num_stages=2, stage=StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1))
    measured = dataclasses.replace(model, durations_us=durations)
    busy = [r.busy_us for r in simulate(plan, measured).estimate.ranks]
    assert busy == [2 * (1 + 2), 2 * (3 + 5)]


def overlap_plan() -> plan_pb2.Plan:
    return build_plan(
        stages=[StageSpec(rank=0, layer_names=("a",)), StageSpec(rank=0, layer_names=("b",))],
        actions={0: "0F0 1F0 (0F1;1B0)OVERLAP_F_B 0B0 1F1 1B1 0B1".split()},
        num_microbatches=2,
    )


@pytest.mark.parametrize(
    ("overlap", "fused", "unit"),
    [
        (None, None, 3),
        (OverlapModel(hidden_fraction=0.0), None, 5),
        (None, 4.0, 4),
        (OverlapModel(use_measured=False), 4.0, 3),
    ],
)
def test_overlap_model(overlap: OverlapModel | None, fused: float | None, unit: float) -> None:
    """Single rank, F 2 and B 3 per stage: the OVERLAP_F_B unit takes max (3), sum (5) or the measured time."""
    plan = overlap_plan()
    profile = uniform_profile(plan, forward_us=2, backward_input_us=2, backward_weight_us=1)
    if fused is not None:
        profile.fused.add(forward_layer_names=["a"], backward_layer_names=["b"], duration_us=fused)
    costs = CostModel.from_profile(plan, profile, overlap=overlap)
    simulation = simulate(plan, costs)
    spans = {t.action: t.end_us - t.start_us for t in simulation.timeline()}
    assert spans["(0F1;1B0)OVERLAP_F_B"] == unit
    assert simulation.estimate.step_time_us == 2 + 2 + unit + 3 + 2 + 3 + 3


def test_cost_model_sums_layers_and_says_what_is_missing() -> None:
    plan = build_plan(
        stages=[StageSpec(rank=0, layer_names=("a", "b")), StageSpec(rank=1, layer_names=("c",))],
        actions={0: "0F0 0SEND_F0 0RECV_B0 0B0".split(), 1: "1RECV_F0 1F0 1B0 1SEND_B0".split()},
        num_microbatches=1,
    )
    profile = uniform_profile(["a", "b", "c"], num_ranks=2, forward_us=1.5, activation_bytes=7, output_bytes=3)
    profile.layers[1].full_backward_duration_us = 10  # b measured its full backward as one graph
    costs = CostModel.from_profile(plan, profile)
    assert costs.stages[0].forward_us == 3.0
    assert costs.stages[0].activation_bytes == 14
    assert costs.stages[0].duration_us(ActionKind.FULL_BACKWARD) == 2 + 10
    assert costs.stages[1].duration_us(ActionKind.FULL_BACKWARD) == 2
    assert costs.stages[0].output_bytes == 3  # the last layer's outputs
    del profile.layers[2]
    with pytest.raises(ValueError, match=r"layers \['c'\] are not in the profile"):
        CostModel.from_profile(plan, profile)
    with pytest.raises(ValueError, match="has no layer names"):
        CostModel.from_profile(gpipe(2, 1), profile)
    del profile.links[:]
    model = CostModel.from_profile(plan, uniform_profile(["a", "b", "c"], num_ranks=1))
    with pytest.raises(ValueError, match="no link cost from rank 1 to rank 0"):
        simulate(plan, model)
    assert simulate(plan, dataclasses.replace(model, default_link=Link())).estimate.step_time_us > 0


def test_bad_costs_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="forward_us must be a finite time >= 0"):
        StageCost(forward_us=-1)
    with pytest.raises(ValueError, match="freed_by_backward_input_bytes"):
        StageCost(activation_bytes=1, freed_by_backward_input_bytes=2)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_second must be > 0"):
        Link(bandwidth_bytes_per_second=0)
    with pytest.raises(ValueError, match="hidden_fraction must be in"):
        OverlapModel(hidden_fraction=2)
    with pytest.raises(ValueError, match="only F, I, W, B, UNSHARD and REDUCE_GRAD"):
        CostModel(stages=(StageCost(),), durations_us={(0, ActionKind.SEND_F): 1.0})
    with pytest.raises(ValueError, match="the cost model has 1 stages but the plan has 2"):
        simulate(gpipe(2, 1), CostModel(stages=(StageCost(),), default_link=Link()))
    with pytest.raises(ValueError, match="tokens_per_sample must be >= 1"):
        SimulationConfig(tokens_per_sample=0)


def test_estimate_proto() -> None:
    plan, profile = profile_for_gpipe()
    plan.ranks[1].memory_cap_bytes = 1 << 20
    simulation = simulate(plan, profile)
    message = simulation.to_proto(timelines=True)
    assert message.step_duration_us == 20
    assert message.plan_name == plan.name
    assert [r.peak_memory_bytes for r in message.ranks] == [148, 144]
    assert not message.ranks[0].HasField("memory_cap_bytes")
    assert message.ranks[1].memory_cap_bytes == 1 << 20
    assert not message.HasField("tokens_per_second")
    assert [len(t.records) for t in message.timelines] == [4, 4]
    assert message.timelines[0].records[0].action.kind == plan_pb2.ACTION_KIND_RECV_B  # posted at the start
    assert message.timelines[0].records[1].action.kind == plan_pb2.ACTION_KIND_FORWARD
    assert message.critical_path[-1].action.kind == plan_pb2.ACTION_KIND_FULL_BACKWARD
    again = estimate_pb2.Estimate.FromString(message.SerializeToString())
    assert again == message
    assert json.loads(json_format.MessageToJson(message))["stepDurationUs"] == 20
    assert simulation.estimate.to_proto().timelines == []


def test_overlap_action_round_trips_into_the_proto() -> None:
    plan = overlap_plan()
    simulation = simulate(plan, uniform_profile(plan))
    records = simulation.to_proto(timelines=True).timelines[0].records
    unit = records[2].action
    assert unit.kind == plan_pb2.ACTION_KIND_OVERLAP_F_B
    assert [(a.kind, a.stage_index, a.microbatch_index) for a in unit.sub_actions] == [
        (plan_pb2.ACTION_KIND_FORWARD, 0, 1),
        (plan_pb2.ACTION_KIND_FULL_BACKWARD, 1, 0),
    ]


def test_chrome_trace(tmp_path: Path) -> None:
    plan, profile = profile_for_gpipe()
    simulation = simulate(plan, profile)
    trace = to_chrome_trace(simulation)
    events = trace["traceEvents"]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert tracks == {(0, "compute"), (0, "collective"), (0, "send -> 1"), (0, "recv <- 1")} | {
        (1, "compute"),
        (1, "collective"),
        (1, "recv <- 0"),
        (1, "send -> 0"),
    }
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 8 and all(e["dur"] >= 0 for e in spans)
    assert {e["pid"] for e in events if e["ph"] == "C" and e["name"] == "memory"} == {0, 1}
    path = tmp_path / "trace.json"
    write_chrome_trace(simulation, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_png_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan = one_f_one_b(4, 8, layer_names=[[f"l{i}"] for i in range(4)])
    simulation = simulate(plan, uniform_profile(plan, activation_bytes=1 << 20, output_bytes=1 << 10, latency_us=0.1))
    path = tmp_path / "timeline.png"
    plot_timeline(simulation, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    plan = gpipe(1, 1)
    simulation = simulate(plan, CostModel.uniform(num_stages=1, stage=StageCost()))
    with pytest.raises(ImportError, match=r"octopipe-simulate\[png\]"):
        plot_timeline(simulation, tmp_path / "x.png")


def test_zero_cost_plan() -> None:
    estimate = simulate(gpipe(2, 2), CostModel.uniform(num_stages=2, stage=StageCost())).estimate
    assert estimate.step_time_us == 0
    assert math.isinf(estimate.samples_per_second)
    assert estimate.bubble_ratio == 0.0
    assert estimate.communication_overlap_ratio == 1.0
