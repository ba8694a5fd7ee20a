"""Simulating plans with a mesh: collectives timed by group size, sharded memory, and no change without one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe.ir import Action, ActionKind, action_to_proto, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    CostModel,
    GroupLinks,
    Link,
    MissingInputError,
    StageCost,
    StageSpec,
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    bucketed_us,
    build_plan,
    reduce_scatter_us,
    simulate,
    uniform_profile,
)
from octopipe.tune import interleaved_1f1b, one_f_one_b, zb_h1
from tests.simulate.reference import reference_times
from tests.simulate.test_properties import cost_models, schedules

FREE = GroupLinks(data_parallel=Link(), expert_parallel=Link())


def with_fsdp(plan: plan_pb2.Plan, dp: int, *, unshard: bool = True) -> plan_pb2.Plan:
    """UNSHARD every stage before the rank's first action; REDUCE_GRAD then RESHARD after its last use."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    placement = {stage.stage_index: stage.rank for stage in plan.stages}
    for rank, actions in rank_actions(plan).items():
        mine = sorted(s for s, r in placement.items() if r == rank)
        last = {s: max(i for i, a in enumerate(actions) if any(c.stage == s for c in a.computations)) for s in mine}
        program = [Action(ActionKind.UNSHARD, s) for s in mine] if unshard else []
        for index, action in enumerate(actions):
            program.append(action)
            for s in mine:
                if last[s] == index:
                    program.append(Action(ActionKind.REDUCE_GRAD, s))
                    if unshard:
                        program.append(Action(ActionKind.RESHARD, s))
        del out.ranks[rank].actions[:]
        out.ranks[rank].actions.extend(action_to_proto(a) for a in program)
    out.mesh.dp = dp
    return out


@pytest.mark.parametrize(
    "plan", [one_f_one_b(4, 8), zb_h1(3, 5), interleaved_1f1b(2, 2, 4)], ids=["1f1b", "zb-h1", "interleaved"]
)
@pytest.mark.parametrize("unshard", [True], ids=["fsdp"])
def test_free_collectives_time_a_mesh_plan_like_pipeline_only(plan: plan_pb2.Plan, unshard: bool) -> None:
    """With zero-cost collectives, dp = 8 gives the dp = 1 (no mesh) timeline, bit for bit."""
    stage = StageCost(forward_us=1.5, backward_input_us=2.25, backward_weight_us=0.75, output_bytes=100)
    costs = CostModel.uniform(num_stages=len(plan.stages), stage=stage, link=Link(latency_us=0.5))
    alone = simulate(with_fsdp(plan, 1, unshard=unshard), costs)
    plan.ClearField("mesh")
    mesh = simulate(with_fsdp(plan, 8, unshard=unshard), CostModel(**{**vars(costs), "collectives": FREE}))
    assert [(t.action, t.start_us, t.end_us) for t in mesh.timeline()] == [
        (t.action, t.start_us, t.end_us) for t in alone.timeline()
    ]
    assert mesh.estimate.step_time_us == alone.estimate.step_time_us
    assert mesh.estimate.samples_per_step == 8 * alone.estimate.samples_per_step


def test_no_mesh_ignores_group_links() -> None:
    """Without a mesh the collectives keep the StageCost's times, even when GroupLinks are given."""
    plan = with_fsdp(one_f_one_b(2, 3), 1)
    plan.ClearField("mesh")
    stage = StageCost(forward_us=1, backward_input_us=1, parameter_bytes=10**9, unshard_us=3, reduce_grad_us=2)
    costs = CostModel.uniform(num_stages=2, stage=stage)
    slow = GroupLinks(data_parallel=Link(latency_us=1e6, bandwidth_bytes_per_second=1.0))
    a, b = simulate(plan, costs), simulate(plan, CostModel(**{**vars(costs), "collectives": slow}))
    assert a.timeline() == b.timeline() and a.estimate == b.estimate


def test_ring_formulas() -> None:
    link = Link(latency_us=2.0, bandwidth_bytes_per_second=1e9)
    assert all_gather_us(link, 4, 1000) == 3 / 4 * 1000 / 1e9 * 1e6 + 3 * 2.0
    assert reduce_scatter_us(link, 4, 1000) == all_gather_us(link, 4, 1000)
    assert all_reduce_us(link, 4, 1000) == 2 * all_gather_us(link, 4, 1000)
    assert all_to_all_us(link, 2, 4000) == 1 / 2 * 4000 / 1e9 * 1e6 + 2.0
    assert all_gather_us(link, 1, 1000) == 0.0
    with pytest.raises(ValueError, match="at least one rank"):
        all_gather_us(link, 0, 1)


def test_buckets_pay_the_latency_once_each() -> None:
    link = Link(latency_us=2.0, bandwidth_bytes_per_second=1e9)
    one = all_gather_us(link, 4, 4000)
    assert bucketed_us(all_gather_us, link, 4, 4000, None) == one
    assert bucketed_us(all_gather_us, link, 4, 4000, 1000) == one  # 1000 B per rank: one bucket
    # 250 B per rank: 4 buckets of 1000 B: the same 3 us of bandwidth, 4 x 3 hops x 2 us
    assert bucketed_us(reduce_scatter_us, link, 4, 4000, 250) == pytest.approx(3.0 + 4 * 6.0)
    stage = StageCost(
        forward_us=1, backward_input_us=1, backward_weight_us=1, parameter_bytes=4000, gradient_bytes=4000
    )
    links = GroupLinks(data_parallel=link)
    plain = simulate(one_rank(HAND, dp=4), CostModel(stages=(stage,), collectives=links))
    cut = simulate(one_rank(HAND, dp=4), CostModel(stages=(stage,), collectives=links, bucket_bytes=250))
    assert cut.estimate.step_time_us - plain.estimate.step_time_us == pytest.approx(2 * 3 * 6.0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        CostModel(stages=(stage,), bucket_bytes=0)


def one_rank(actions: str, *, dp: int, ep: int = 1, microbatches: int = 2) -> plan_pb2.Plan:
    plan = build_plan(stages=[StageSpec(rank=0)], actions={0: actions.split()}, num_microbatches=microbatches)
    plan.mesh.dp, plan.mesh.ep = dp, ep
    return plan


HAND = "0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD"


def test_collectives_are_timed_by_group_size_on_their_stream() -> None:
    """dp = 4, 4000 parameter bytes, 8000 gradient bytes, 1 GB/s, 2 us a hop: AG 9 us, RS 12 us."""
    stage = StageCost(
        forward_us=1, backward_input_us=1, backward_weight_us=1, parameter_bytes=4000, gradient_bytes=8000
    )
    links = GroupLinks(data_parallel=Link(latency_us=2.0, bandwidth_bytes_per_second=1e9))
    simulation = simulate(one_rank(HAND, dp=4), CostModel(stages=(stage,), collectives=links))
    spans = [(t.action, t.stream, t.start_us, t.end_us) for t in simulation.timeline()]
    assert spans == [
        ("0UNSHARD", "collective", 0, 9.0),  # 3/4 * 4000 B / 1 GB/s = 3 us, + 3 hops x 2 us
        ("0F0", "compute", 9.0, 10.0),  # waits for its parameters
        ("0F1", "compute", 10.0, 11.0),
        ("0B0", "compute", 11.0, 13.0),
        ("0B1", "compute", 13.0, 15.0),
        ("0REDUCE_GRAD", "collective", 15.0, 27.0),  # 3/4 * 8000 B = 6 us, + 6 us
        ("0RESHARD", "collective", 27.0, 27.0),
    ]
    with pytest.raises(MissingInputError, match="put 0UNSHARD before it"):  # dp > 1 shards every stage
        simulate(
            one_rank(HAND.replace("0UNSHARD ", "").replace(" 0RESHARD", ""), dp=4),
            CostModel(stages=(stage,), collectives=links),
        )


def test_sharded_memory_by_hand() -> None:
    """dp = 4: static = 1/4 of (400 params + 400 grads + 800 optimizer) = 400; UNSHARD holds 400 more;
    the unsharded gradients (400) from the first B until REDUCE_GRAD ends; activations 10 per F."""
    stage = StageCost(
        forward_us=1,
        backward_input_us=1,
        backward_weight_us=1,
        activation_bytes=10,
        parameter_bytes=400,
        gradient_bytes=400,
        optimizer_state_bytes=800,
        unshard_us=5,
        reduce_grad_us=3,
    )
    fsdp = simulate(one_rank(HAND, dp=4), CostModel(stages=(stage,)))
    # t=0 UNSHARD +400; 5, 6: F +10 each; 7: B0 starts +400; 9: B0 frees 10; 11: B1 frees 10;
    # 11-14 REDUCE_GRAD, then the unsharded gradients go; 14: RESHARD.
    assert fsdp.memory_curve(0) == [(0, 800), (5, 810), (6, 820), (7, 1220), (9, 1210), (11, 1200), (14, 400)]
    assert fsdp.estimate.ranks[0].static_memory_bytes == 400
    assert (fsdp.estimate.ranks[0].peak_memory_bytes, fsdp.estimate.ranks[0].peak_memory_time_us) == (1220, 7)
    # the same plan on one replica: whole static bytes, gradients counted in them
    alone = simulate(one_rank(HAND, dp=1), CostModel(stages=(stage,)))
    assert alone.memory_curve(0) == [(0, 2000), (5, 2010), (6, 2020), (9, 2010), (11, 2000), (14, 1600)]
    # dp = 3 rounds each shard up: 134 + 134 + 267
    assert simulate(one_rank(HAND, dp=3), CostModel(stages=(stage,))).estimate.ranks[0].static_memory_bytes == 535


def test_all_to_all_is_paid_inside_forward_and_input_backward() -> None:
    stage = StageCost(forward_us=10, backward_input_us=20, backward_weight_us=5, all_to_all_bytes=2000)
    links = GroupLinks(data_parallel=Link(), expert_parallel=Link(latency_us=1.0, bandwidth_bytes_per_second=1e9))
    a2a = all_to_all_us(links.expert_parallel_link(0), 2, 2000)
    assert a2a == 2.0
    plan = one_rank("0UNSHARD 0F0 0I0 0W0 0F1 (0F2;0B1)OVERLAP_F_B 0B2 0REDUCE_GRAD", dp=2, ep=2, microbatches=3)
    spans = {
        t.action: t.end_us - t.start_us
        for t in simulate(plan, CostModel(stages=(stage,), collectives=links)).timeline()
    }
    assert spans["0F0"] == 10 + a2a and spans["0I0"] == 20 + a2a and spans["0W0"] == 5
    # OVERLAP_F_B (default model max(F, B)): the longer of the compute (25) and both all-to-alls (4)
    assert spans["(0F2;0B1)OVERLAP_F_B"] == 25 and spans["0B2"] == 25 + a2a
    # ep = 1: no all-to-all
    plan.mesh.ep = 1
    spans = {
        t.action: t.end_us - t.start_us
        for t in simulate(plan, CostModel(stages=(stage,), collectives=links)).timeline()
    }
    assert spans["0F0"] == 10


def test_group_links_from_the_profile() -> None:
    profile = uniform_profile(["a", "b"], num_ranks=2, parameter_bytes=1000, gradient_bytes=1000)
    dp = profile_pb2.GROUP_KIND_DATA_PARALLEL
    profile.collectives.add(group=dp, latency_us=1.0, bandwidth_bytes_per_second=1e9)
    profile.collectives.add(group=dp, pipeline_rank=1, latency_us=5.0, bandwidth_bytes_per_second=1e8)
    links = GroupLinks.from_profile(profile)
    assert links is not None
    assert links.data_parallel_link(0) == Link(latency_us=1.0, bandwidth_bytes_per_second=1e9)
    assert links.data_parallel_link(1) == Link(latency_us=5.0, bandwidth_bytes_per_second=1e8)
    assert GroupLinks.from_profile(profile_pb2.Profile(collectives=links.to_proto())) == links
    with pytest.raises(ValueError, match="GROUP_KIND_EXPERT_PARALLEL"):
        links.expert_parallel_link(0)
    plan = with_fsdp(one_f_one_b(2, 2), 2)
    for stage, names in zip(plan.stages, (["a"], ["b"]), strict=True):
        stage.layer_names.extend(names)
    durations = {t.action: t.end_us - t.start_us for t in simulate(plan, profile).timeline()}
    assert durations["0UNSHARD"] == pytest.approx(0.5 * 1000 / 1e9 * 1e6 + 1.0)
    assert durations["1UNSHARD"] == pytest.approx(0.5 * 1000 / 1e8 * 1e6 + 5.0)
    profile.collectives.add(group=profile_pb2.GROUP_KIND_UNSPECIFIED)
    with pytest.raises(ValueError, match=r"collectives\[2\]: set group"):
        GroupLinks.from_profile(profile)
    assert not math.isnan(durations["1REDUCE_GRAD"])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_group_timed_collectives_agree_with_explicit_times_and_the_reference(data: st.DataObject) -> None:
    """Timing UNSHARD / REDUCE_GRAD by group size gives, bit for bit, the step that the same ring times written
    into the StageCosts give, and both agree with the independent reference model."""
    dp = data.draw(st.sampled_from([2, 3, 8]))
    unshard = True  # dp > 1 shards every stage (a replicated stage is refused: the runtime shards them all)
    plan = with_fsdp(data.draw(schedules()), dp, unshard=unshard)
    base = data.draw(cost_models(len(plan.stages), len(plan.ranks)))
    link = Link(
        latency_us=data.draw(st.sampled_from([0.0, 1.5, 7.0])),
        bandwidth_bytes_per_second=data.draw(st.sampled_from([1e6, 3e7, math.inf])),
    )
    sizes = [(data.draw(st.integers(0, 10**6)), data.draw(st.integers(0, 10**6))) for _ in range(len(plan.stages))]
    stages = tuple(
        replace(stage, parameter_bytes=params, gradient_bytes=grads)
        for stage, (params, grads) in zip(base.stages, sizes, strict=True)
    )
    by_group = replace(base, stages=stages, collectives=GroupLinks(data_parallel=link))
    reduce = reduce_scatter_us
    explicit = replace(
        base,
        stages=tuple(
            replace(
                s,
                unshard_us=all_gather_us(link, dp, s.parameter_bytes),
                reduce_grad_us=reduce(link, dp, s.gradient_bytes),
            )
            for s in stages
        ),
    )
    got = simulate(plan, by_group)
    assert got.timeline() == simulate(plan, explicit).timeline()
    expected = reference_times(plan, explicit)
    assert {(t.rank, t.step): (t.start_us, t.end_us) for t in got.timeline()} == expected
    slower = replace(by_group, collectives=GroupLinks(data_parallel=replace(link, latency_us=link.latency_us + 10)))
    assert simulate(plan, slower).estimate.step_time_us >= got.estimate.step_time_us


def test_small_groups_take_the_node_link() -> None:
    """A `max_group_size` entry (e.g. NVLink inside an 8-GPU node) times groups that fit; larger ones the default."""
    nvlink = Link(latency_us=1.0, bandwidth_bytes_per_second=4.5e11)
    ib = Link(latency_us=5.0, bandwidth_bytes_per_second=5e10)
    links = GroupLinks(data_parallel=ib, data_parallel_within={8: nvlink, 2: Link(latency_us=0.5)})
    assert links.data_parallel_link(0, 8) == nvlink and links.data_parallel_link(0, 3) == nvlink
    assert links.data_parallel_link(0, 2) == Link(latency_us=0.5)
    assert links.data_parallel_link(0, 16) == ib and links.data_parallel_link(0) == ib
    override = GroupLinks(data_parallel_within={8: nvlink}, data_parallel_by_rank={1: ib})
    assert override.data_parallel_link(1, 4) == ib
    with pytest.raises(ValueError, match="a group of 16 ranks"):
        override.data_parallel_link(0, 16)
    assert GroupLinks.from_profile(profile_pb2.Profile(collectives=links.to_proto())) == links
    stage = StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1, parameter_bytes=8000, gradient_bytes=8)
    for dp, link in ((4, nvlink), (16, ib)):
        timeline = simulate(one_rank(HAND, dp=dp), CostModel(stages=(stage,), collectives=links)).timeline()
        assert timeline[0].end_us == all_gather_us(link, dp, 8000)
    both = profile_pb2.Profile()
    both.collectives.add(group=profile_pb2.GROUP_KIND_DATA_PARALLEL, pipeline_rank=0, max_group_size=8)
    both.collectives[0].bandwidth_bytes_per_second = 1e9
    with pytest.raises(ValueError, match="not both"):
        GroupLinks.from_profile(both)


def test_expert_parallel_shares_by_hand() -> None:
    """dp = 4, ep = 2; 1000 parameter bytes of which 800 in experts; gradients 1000, optimizer state 2000.

    A rank holds whole the dense 200 and half the experts (400): UNSHARD gathers 200 over 4 ranks and 400 over
    the 2 replicas that share its experts; static bytes are 1/dp of everything (1000)."""
    stage = StageCost(
        forward_us=1,
        backward_input_us=1,
        backward_weight_us=1,
        parameter_bytes=1000,
        expert_parameter_bytes=800,
        gradient_bytes=1000,
        optimizer_state_bytes=2000,
    )
    link = Link(latency_us=0.25, bandwidth_bytes_per_second=1e9)
    costs = CostModel(stages=(stage,), collectives=GroupLinks(data_parallel=link))
    simulation = simulate(one_rank(HAND, dp=4, ep=2), costs)
    timeline = {t.action: (t.start_us, t.end_us) for t in simulation.timeline()}
    gather = all_gather_us(link, 4, 200) + all_gather_us(link, 2, 400)
    assert timeline["0UNSHARD"] == (0.0, gather)
    start, end = timeline["0REDUCE_GRAD"]
    assert end == start + (reduce_scatter_us(link, 4, 200) + reduce_scatter_us(link, 2, 400))
    b0 = timeline["0B0"][0]
    assert simulation.memory_curve(0) == [(0.0, 1000 + 600), (b0, 1000 + 600 + 600), (end, 1000)]
    # ep = 1: the experts are not split
    assert simulate(one_rank(HAND, dp=4), costs).memory_curve(0)[0] == (0.0, 1000 + 1000)
    with pytest.raises(ValueError, match="at most parameter_bytes"):
        StageCost(parameter_bytes=10, expert_parameter_bytes=11)
