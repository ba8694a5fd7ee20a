"""Tensor and context parallelism in the simulator: closed forms of the cost formulas on one-layer profiles.

Every expected time is written out from octopipe.simulate.tensor_parallel's formulas (ring all-reduce
2 ((n-1)/n B / bw + (n-1) lat); all-gather / reduce-scatter (n-1)/n B / bw + (n-1) lat), not read back
from the simulator.
"""

from __future__ import annotations

import pytest

from octopipe.ir import PlanError
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    CostModel,
    GroupLinks,
    Link,
    all_gather_us,
    simulate,
    split_layer,
    stage_cost_from_layers,
)
from octopipe.tune import one_f_one_b, zb_h1

F_US, I_US, W_US = 100.0, 120.0, 80.0
OUT = 4096  # bytes of the layer's output tensor ([b, s, h])
PARAMS, GRADS, OPT = 800, 800, 1600
TP_LINK = Link(latency_us=3.0, bandwidth_bytes_per_second=1e9)
CP_LINK = Link(latency_us=7.0, bandwidth_bytes_per_second=2e9)


def _profile(kind: str = "attention", **fields: object) -> profile_pb2.Profile:
    profile = profile_pb2.Profile(device="test", microbatch_size=1)
    layer = profile.layers.add(
        layer_name="layer",
        layer_type=kind,
        forward_duration_us=F_US,
        backward_input_duration_us=I_US,
        backward_weight_duration_us=W_US,
        activation_saved_bytes=1000,
        activation_freed_by_backward_input_bytes=400,
        activation_freed_by_backward_weight_bytes=600,
        parameter_bytes=PARAMS,
        gradient_bytes=GRADS,
        optimizer_state_bytes=OPT,
        **fields,
    )
    layer.output_tensors.add(shape=[8, OUT // 8], dtype="uint8", size_bytes=OUT)
    profile.collectives.extend(GroupLinks(tensor_parallel=TP_LINK, context_parallel=CP_LINK).to_proto())
    return profile


def _plan(tp: int = 1, cp: int = 1, *, split: bool = False) -> plan_pb2.Plan:
    """One rank, one stage of the one layer, one micro-batch: F then B (or F, I, W)."""
    plan = (zb_h1 if split else one_f_one_b)(1, 1, layer_names=[["layer"]])
    if tp * cp > 1:
        plan.mesh.tp, plan.mesh.cp = tp, cp
    return plan


def _all_reduce(link: Link, n: int, size: float, count: int = 1) -> float:
    return 2 * ((n - 1) / n * size / link.bandwidth_bytes_per_second * 1e6 + count * (n - 1) * link.latency_us)


def _gather(link: Link, n: int, size: float) -> float:
    return (n - 1) / n * size / link.bandwidth_bytes_per_second * 1e6 + (n - 1) * link.latency_us


def test_tp2_halves_compute_and_parameters_and_pays_one_all_reduce_each_way() -> None:
    """tp = 2, attention layer: F = F/2 + AR(O), B = (I+W)/2 + AR(O); static bytes / 2."""
    one = simulate(_plan(), _profile())
    two = simulate(_plan(tp=2), _profile())
    ar = _all_reduce(TP_LINK, 2, OUT)
    times = {t.action: t.end_us - t.start_us for t in two.timeline()}
    assert times["0F0"] == pytest.approx(F_US / 2 + ar, rel=1e-12)
    assert times["0B0"] == pytest.approx((I_US + W_US) / 2 + ar, rel=1e-12)
    assert two.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 2 * ar, rel=1e-12)
    assert one.estimate.step_time_us == F_US + I_US + W_US
    assert two.estimate.ranks[0].static_memory_bytes == (PARAMS + GRADS + OPT) // 2
    assert one.estimate.ranks[0].static_memory_bytes == PARAMS + GRADS + OPT
    # the same samples: tp splits the work of one micro-batch, it adds no replica
    assert two.estimate.samples_per_step == one.estimate.samples_per_step


def test_tp_split_backward_w_has_no_collective() -> None:
    """F, I pay the all-reduce; W is the weight-gradient matmuls only, / tp."""
    sim = simulate(_plan(tp=4, split=True), _profile())
    ar = _all_reduce(TP_LINK, 4, OUT)
    times = {t.action: t.end_us - t.start_us for t in sim.timeline()}
    assert times["0F0"] == pytest.approx(F_US / 4 + ar, rel=1e-12)
    # the first stage's input needs a gradient here (no input_without_gradient): I and W split
    assert times["0I0"] == pytest.approx(I_US / 4 + ar, rel=1e-12)
    assert times["0W0"] == pytest.approx(W_US / 4, rel=1e-12)


def test_tp_activation_split_keeps_the_replicated_part_whole() -> None:
    """Saved activations R + (A - R) / tp; the default R = min(A, 2 k O) keeps a checkpointed layer whole."""
    replicated = 200
    stage = stage_cost_from_layers([_profile(tensor_parallel_replicated_activation_bytes=replicated).layers[0]], tp=2)
    assert stage.activation_bytes == replicated + (1000 - replicated) // 2
    assert stage.freed_by_backward_input_bytes == 400 * stage.activation_bytes // 1000
    default = stage_cost_from_layers([_profile().layers[0]], tp=2)
    assert default.activation_bytes == 1000  # A = 1000 <= 2 * O: all of it is the replicated norm in/out
    sim = simulate(_plan(tp=2), _profile(tensor_parallel_replicated_activation_bytes=replicated))
    assert sim.estimate.ranks[0].peak_activation_bytes == replicated + (1000 - replicated) // 2


def test_mamba_pays_two_all_reduces_and_profile_fields_override() -> None:
    """A Mamba mixer: x_proj's and out_proj's all-reduces (latency twice); explicit bytes and counts win."""
    sim = simulate(_plan(tp=2), _profile("mamba2"))
    ar = _all_reduce(TP_LINK, 2, OUT, count=2)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 2 * ar, rel=1e-12)
    fields = {"tensor_parallel_all_reduce_bytes": 5000, "tensor_parallel_all_reduces": 3}
    sim = simulate(_plan(tp=2), _profile("mamba2", **fields))
    ar = _all_reduce(TP_LINK, 2, 5000, count=3)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 2 * ar, rel=1e-12)


def test_recomputing_backward_repeats_the_forward_collectives() -> None:
    sim = simulate(_plan(tp=2), _profile(backward_recomputes_forward=True))
    ar = _all_reduce(TP_LINK, 2, OUT)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 3 * ar, rel=1e-12)


def test_replicated_layers_keep_their_compute_and_bytes_over_tp() -> None:
    """A layer of a kind the runtime does not split (replicated on tp ranks): no division by tp, no all-reduce."""
    sim = simulate(_plan(tp=2), _profile("norm"))
    assert sim.estimate.step_time_us == F_US + I_US + W_US
    assert sim.estimate.ranks[0].static_memory_bytes == PARAMS + GRADS + OPT


def test_the_head_splits_by_vocabulary_without_sequence_parallelism() -> None:
    """A head over tp=2 (the runtime's loss parallelism): compute and weights / 2; forward, three all-reduces of
    one value per token (the cross-entropy's max, sum, target logit: 8 tokens x 1 byte here); backward, its input
    gradient's all-reduce (0 bytes in a one-layer stage: the boundary is not known here, latency only)."""
    sim = simulate(_plan(tp=2), _profile("head"))
    tokens = 8  # output [8, 512] uint8: 8 tokens of a 512-entry vocabulary slice
    forward = _all_reduce(TP_LINK, 2, 3 * tokens) + 2 * _all_reduce(TP_LINK, 2, 0)
    backward = _all_reduce(TP_LINK, 2, 0)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + forward + backward, rel=1e-12)
    assert sim.estimate.ranks[0].static_memory_bytes == (PARAMS + GRADS + OPT) // 2


def test_cp2_gathers_keys_and_values_and_all_reduces_gradients() -> None:
    """cp = 2: compute / 2; F all-gathers KV = 2 O, B reduce-scatters it; the gradients are all-reduced over cp
    once per step (no REDUCE_GRAD here: at the step's end); boundary tensors / cp."""
    sim = simulate(_plan(cp=2), _profile())
    gather = _gather(CP_LINK, 2, 2 * OUT)
    grads = _all_reduce(CP_LINK, 2, GRADS)
    times = {t.action: t.end_us - t.start_us for t in sim.timeline()}
    assert times["0F0"] == pytest.approx(F_US / 2 + gather, rel=1e-12)
    assert times["0B0"] == pytest.approx((I_US + W_US) / 2 + gather, rel=1e-12)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 2 * gather + grads, rel=1e-12)
    assert sim.estimate.ranks[0].static_memory_bytes == PARAMS + GRADS + OPT  # cp ranks hold whole weights
    stage = stage_cost_from_layers(_profile().layers, cp=2)
    assert stage.output_bytes == OUT // 2
    assert stage.activation_bytes == 500
    # the other rank's keys and values are held while F runs: (cp - 1) / cp * KV
    assert stage.forward_scratch_bytes == OUT


def test_tp_and_cp_together() -> None:
    """tp = 2, cp = 2: compute / 4; all-reduce of O / cp over tp; all-gather of KV / tp over cp."""
    sim = simulate(_plan(tp=2, cp=2), _profile())
    ar = _all_reduce(TP_LINK, 2, OUT // 2)
    gather = _gather(CP_LINK, 2, 2 * OUT // 2)
    grads = _all_reduce(CP_LINK, 2, GRADS // 2)
    expected = (F_US + I_US + W_US) / 4 + 2 * (ar + gather) + grads
    assert sim.estimate.step_time_us == pytest.approx(expected, rel=1e-12)


def test_cp_refused_on_mamba_layers() -> None:
    with pytest.raises(ValueError, match="Mamba"):
        simulate(_plan(cp=2), _profile("mamba"))
    with pytest.raises(ValueError, match="cp=1"):
        split_layer(_profile("attention+mamba2").layers[0], 1, 2)


def test_tp_cp_one_changes_nothing() -> None:
    """tp = cp = 1: the StageCost and the whole timeline are those of a plan without a mesh, bit for bit."""
    layer = _profile().layers[0]
    assert stage_cost_from_layers([layer], tp=1, cp=1) == stage_cost_from_layers([layer])
    plan = zb_h1(2, 4, layer_names=[["layer"], ["layer2"]])
    profile = _profile()
    second = profile.layers.add()
    second.CopyFrom(profile.layers[0])
    second.layer_name = "layer2"
    profile.links.add(source_rank=0, destination_rank=1, latency_us=1.0, bandwidth_bytes_per_second=1e9)
    profile.links.add(source_rank=1, destination_rank=0, latency_us=1.0, bandwidth_bytes_per_second=1e9)
    alone = simulate(plan, profile)
    plan.mesh.tp, plan.mesh.cp = 1, 1
    meshed = simulate(plan, profile)
    assert [(t.action, t.start_us, t.end_us) for t in meshed.timeline()] == [
        (t.action, t.start_us, t.end_us) for t in alone.timeline()
    ]
    assert meshed.estimate == alone.estimate


def test_tp_group_falls_back_to_the_node_link_and_dp_groups_span_cp_tp() -> None:
    """Without TP entries the tp group takes the data-parallel entry for its size (inside a node: NVLink); a dp
    group of dp ranks tp apart spans dp x tp ranks, which picks its link."""
    fast, slow = (
        Link(latency_us=1.0, bandwidth_bytes_per_second=400e9),
        Link(latency_us=5.0, bandwidth_bytes_per_second=50e9),
    )
    links = GroupLinks(data_parallel=slow, data_parallel_within={8: fast})
    assert links.tensor_parallel_link(0, 8) is fast
    assert links.context_parallel_link(0, 2, 16) is slow
    profile = _profile()
    del profile.collectives[:]
    profile.collectives.extend(links.to_proto())
    plan = _plan(tp=4)
    sim = simulate(plan, profile)
    assert sim.estimate.step_time_us == pytest.approx(
        (F_US + I_US + W_US) / 4 + 2 * _all_reduce(fast, 4, OUT), rel=1e-12
    )
    # FSDP over dp = 2 replicas 4 ranks apart: the group spans 8 ranks (one node): the fast link
    fsdp = plan_pb2.Plan()
    fsdp.CopyFrom(plan)
    actions = fsdp.ranks[0].actions
    unshard = plan_pb2.Action(kind=plan_pb2.ACTION_KIND_UNSHARD, stage_index=0)
    reduce = plan_pb2.Action(kind=plan_pb2.ACTION_KIND_REDUCE_GRAD, stage_index=0)
    rest = list(actions)
    del actions[:]
    actions.extend([unshard, *rest, reduce])
    for dp, link in ((2, fast), (4, slow)):
        fsdp.mesh.dp = dp
        timed = {t.action: t.end_us - t.start_us for t in simulate(fsdp, profile).timeline()}
        assert timed["0UNSHARD"] == pytest.approx(all_gather_us(link, dp, PARAMS // 4), rel=1e-12)


def test_group_links_round_trip_with_tp_and_cp_entries() -> None:
    links = GroupLinks(
        data_parallel=Link(latency_us=1.0, bandwidth_bytes_per_second=1e9),
        tensor_parallel=TP_LINK,
        context_parallel_within={16: CP_LINK},
        tensor_parallel_by_rank={3: CP_LINK},
    )
    profile = profile_pb2.Profile()
    profile.collectives.extend(links.to_proto())
    assert GroupLinks.from_profile(profile) == links


def test_cost_model_for_another_mesh_is_refused() -> None:
    model = CostModel.from_profile(_plan(tp=2), _profile())
    with pytest.raises(ValueError, match="tp=2"):
        simulate(_plan(tp=4), model)


def test_plan_verifier_still_checks_the_mesh() -> None:
    plan = _plan(tp=2)
    plan.mesh.global_ranks.extend([0, 0])
    with pytest.raises(PlanError):
        simulate(plan, _profile())


def test_moe_experts_split_over_tp() -> None:
    """The runtime splits every expert's hidden units: a MoE layer's compute and experts / tp."""
    layer = _profile("moe", expert_parameter_bytes=600).layers[0]
    stage = stage_cost_from_layers([layer], tp=2)
    assert stage.forward_us == F_US / 2
    assert stage.parameter_bytes == PARAMS // 2 and stage.expert_parameter_bytes == 300
    assert stage.parallel is not None and stage.parallel.tp_forward_bytes == OUT


def _sp_plan(tp: int = 2) -> plan_pb2.Plan:
    plan = _plan(tp=tp)
    plan.mesh.sequence_parallel = True
    return plan


def test_sequence_parallel_layers_pay_the_same_bytes_and_keep_only_their_gathered_input_whole() -> None:
    """Sequence parallelism: the all-gather in and reduce-scatter out of a split layer take a ring all-reduce's
    time; its saved activations keep one [b, s, h] (the gathered input, O) whole and split the rest."""
    sim = simulate(_sp_plan(), _profile())
    ar = _all_reduce(TP_LINK, 2, OUT)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + 2 * ar, rel=1e-12)
    whole = min(1000, OUT)  # A = 1000 <= O: the gathered input is all of it
    stage = stage_cost_from_layers([_profile().layers[0]], tp=2, sequence_parallel=True)
    assert stage.activation_bytes == whole + (1000 - whole) // 2
    small = _profile()
    small.layers[0].output_tensors[0].size_bytes = 100  # O = 100: 100 whole, 900 split
    assert stage_cost_from_layers([small.layers[0]], tp=2, sequence_parallel=True).activation_bytes == 100 + 450


def test_sequence_parallel_replicated_layers_run_on_their_slice_and_average_gradients_per_step() -> None:
    """A head under sequence parallelism: compute, activations and outputs / tp (1/tp of the tokens); once per
    step its gradient is all-reduced over the tp group (it holds its slice's share)."""
    profile = _profile("head")
    share = split_layer(profile.layers[0], 2, 1, True)
    assert share.forward_duration_us == F_US / 2
    assert share.activation_saved_bytes == 500
    assert share.output_tensors[0].size_bytes == OUT // 2
    sim = simulate(_sp_plan(), profile)
    assert sim.estimate.step_time_us == pytest.approx((F_US + I_US + W_US) / 2 + _all_reduce(TP_LINK, 2, GRADS))
    assert sim.estimate.ranks[0].static_memory_bytes == PARAMS + GRADS + OPT  # the weights stay whole
