"""The runtime's own costs as named terms of the cost model (issue 36): closed forms, bounds, the profile's
field, and every consumer reading the same terms (the simulator, both tuner paths, the tuner, retune)."""

from __future__ import annotations

import dataclasses

import pytest

from octopipe.ir import ActionKind
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    BOUNDS,
    DISPATCHED_KINDS,
    CostModel,
    Link,
    MessageCpu,
    RuntimeCosts,
    StageCost,
    local_cost_model,
    simulate,
    uniform_profile,
    verify_plan,
)
from octopipe.tune import (
    ListSchedulerConfig,
    TuneConfig,
    list_schedule,
    one_f_one_b,
    tune,
    zb_h1,
)
from octopipe.tune.retune import calibrated_costs

F, I, W, B = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.FULL_BACKWARD  # noqa: E741


def costs_of(p: int, *, f: float = 10.0, b: float = 20.0, latency: float = 0.0, out: int = 0) -> CostModel:
    stage = StageCost(
        forward_us=f, full_backward_us=b, backward_input_us=b / 2, backward_weight_us=b / 2, output_bytes=out
    )
    return CostModel.uniform(num_stages=p, stage=stage, link=Link(latency_us=latency))


def with_runtime(costs: CostModel, runtime: RuntimeCosts) -> CostModel:
    return dataclasses.replace(costs, runtime=runtime)


def step_us(plan, costs: CostModel) -> float:  # type: ignore[no-untyped-def]
    return simulate(plan, costs).estimate.step_time_us


def test_dispatch_adds_to_every_action_of_its_kind_1f1b_closed_form() -> None:
    """1F1B on free links: (m + p - 1)(f + b) (shared/facts.md); a dispatch of d_F per F and d_B per B is
    work the program does, so the step is (m + p - 1)(f + d_F + b + d_B)."""
    for p, m in ((2, 4), (4, 8), (3, 3)):
        plan = one_f_one_b(p, m)
        runtime = RuntimeCosts(dispatch_us={F: 1.5, B: 2.5})
        assert step_us(plan, costs_of(p)) == (m + p - 1) * 30.0
        assert step_us(plan, with_runtime(costs_of(p), runtime)) == pytest.approx((m + p - 1) * 34.0)


def test_every_term_in_one_closed_form() -> None:
    """1F1B, p = 2, m = 1: F, message, F, B, message, B in a chain. Each message takes the link plus both ends'
    CPU work; each post costs its rank the dispatch of the SEND or RECV and the thread's share of its end's
    CPU work. Step = 2(f + b + d_F + d_B) + 2(s + l + r) + 2(share (s + r) + d_SEND + d_RECV)."""
    f, b, latency, s, r, share = 10.0, 20.0, 3.0, 4.0, 8.0, 0.5
    dispatch = {F: 1.0, B: 2.0, ActionKind.SEND_F: 0.5, ActionKind.SEND_B: 0.5}
    dispatch |= {ActionKind.RECV_F: 0.25, ActionKind.RECV_B: 0.25}
    runtime = RuntimeCosts(
        dispatch_us=dispatch, send_cpu=MessageCpu(fixed_us=s), recv_cpu=MessageCpu(fixed_us=r), thread_share=share
    )
    plan = one_f_one_b(2, 1)
    costs = costs_of(2, f=f, b=b, latency=latency)
    assert step_us(plan, costs) == 2 * (f + b) + 2 * latency
    expected = 2 * (f + b + 1.0 + 2.0) + 2 * (s + latency + r) + 2 * (share * (s + r) + 0.5 + 0.25)
    assert step_us(plan, with_runtime(costs, runtime)) == pytest.approx(expected)


def test_message_cpu_without_a_share_of_the_core_is_latency_on_the_path() -> None:
    """With thread_share 0 a message's CPU work only lengthens its path: s + r of it is the same step as
    s + r more link latency, on any plan; per MiB it scales with the message's bytes."""
    for plan in (zb_h1(4, 8), one_f_one_b(3, 6)):
        p = len(plan.stages)
        runtime = RuntimeCosts(send_cpu=MessageCpu(fixed_us=3.0), recv_cpu=MessageCpu(fixed_us=4.5))
        assert step_us(plan, with_runtime(costs_of(p, latency=2.0), runtime)) == step_us(plan, costs_of(p, latency=9.5))
        mib = 1 << 20
        per_byte = RuntimeCosts(recv_cpu=MessageCpu(us_per_mib=8.0))
        assert step_us(plan, with_runtime(costs_of(p, out=mib // 2), per_byte)) == step_us(
            plan, costs_of(p, latency=4.0, out=mib // 2)
        )


def test_the_default_is_no_runtime_cost() -> None:
    plan = zb_h1(4, 8)
    costs = costs_of(4, latency=5.0)
    assert costs.runtime.is_zero
    assert step_us(plan, costs) == step_us(plan, with_runtime(costs, RuntimeCosts(dispatch_us={F: 0.0})))


def test_terms_outside_their_physical_bounds_are_refused_with_the_bounds() -> None:
    low, high = BOUNDS["dispatch_us"]
    with pytest.raises(ValueError, match=rf"dispatch_us\[F\] must be within its physical bounds \[{low:g}, {high:g}\]"):
        RuntimeCosts(dispatch_us={F: high + 1})
    with pytest.raises(ValueError, match="physical bounds"):
        RuntimeCosts(dispatch_us={F: -1.0})
    with pytest.raises(ValueError, match="collectives run on their own stream"):
        RuntimeCosts(dispatch_us={ActionKind.UNSHARD: 1.0})
    with pytest.raises(ValueError, match="thread_share"):
        RuntimeCosts(thread_share=1.5)
    with pytest.raises(ValueError, match="us_per_mib"):
        MessageCpu(us_per_mib=BOUNDS["message_us_per_mib"][1] * 2)
    with pytest.raises(ValueError, match="fixed_us"):
        MessageCpu(fixed_us=float("nan"))


def test_the_profile_carries_the_terms_and_every_model_built_from_it_reads_them() -> None:
    runtime = RuntimeCosts(
        dispatch_us={F: 3.0, W: 1.0, ActionKind.SEND_F: 0.5},
        send_cpu=MessageCpu(fixed_us=2.0, us_per_mib=10.0),
        recv_cpu=MessageCpu(fixed_us=4.0),
        thread_share=1.0,
    )
    message = runtime.to_proto(source="test")
    assert RuntimeCosts.from_proto(profile_pb2.RuntimeCost.FromString(message.SerializeToString())) == runtime
    assert runtime.terms()["dispatch_us.F"] == 3.0 and runtime.terms()["recv_cpu.fixed_us"] == 4.0
    assert RuntimeCosts.from_terms(runtime.terms()) == dataclasses.replace(
        runtime, dispatch_us={kind: runtime.dispatch(kind) for kind in DISPATCHED_KINDS}
    )
    with pytest.raises(ValueError, match="unknown runtime cost terms"):
        RuntimeCosts.from_terms({"dispatch_us.UNSHARD": 1.0})
    plan = zb_h1(2, 4, layer_names=[["l0"], ["l1"]])
    profile = uniform_profile(plan)
    without = local_cost_model(plan, profile)
    profile.runtime.CopyFrom(message)
    with_terms = local_cost_model(plan, profile)
    assert with_terms.runtime == runtime and without.runtime.is_zero
    assert step_us(plan, with_terms) > step_us(plan, without)
    assert calibrated_costs(plan, profile, []).runtime == runtime  # retune's costs
    bad = profile_pb2.RuntimeCost(thread_share=2.0)
    profile.runtime.CopyFrom(bad)
    with pytest.raises(ValueError, match=r"profile runtime costs: RuntimeCosts\.thread_share"):
        local_cost_model(plan, profile)


def test_the_list_scheduler_reads_the_terms() -> None:
    """The same stages and link: a receive-side CPU cost per message, or a dispatch per W, changes the order the
    list scheduler builds (it fills the gaps these open with W)."""
    stage = StageCost(forward_us=10, backward_input_us=10, backward_weight_us=10, activation_bytes=4, output_bytes=100)
    costs = CostModel.uniform(num_stages=2, stage=stage, link=Link())
    config = ListSchedulerConfig(priority="backward")
    plain = list_schedule(costs, [0, 1], 4, config=config)
    for runtime in (RuntimeCosts(recv_cpu=MessageCpu(fixed_us=15.0)), RuntimeCosts(dispatch_us={W: 25.0})):
        assert list_schedule(with_runtime(costs, runtime), [0, 1], 4, config=config) != plain


def test_the_exact_scheduler_reads_the_terms() -> None:
    """The MILP's durations include the dispatch: its own makespan grows by it and still equals the simulator's
    step of the plan it returns."""
    pytest.importorskip("highspy")
    from octopipe.tune import exact_schedule

    stage = StageCost(forward_us=1, backward_input_us=1, backward_weight_us=1, activation_bytes=4)
    costs = CostModel.uniform(num_stages=2, stage=stage)
    plain = exact_schedule(costs, [0, 1], 4, time_limit_s=30)
    slow = exact_schedule(with_runtime(costs, RuntimeCosts(dispatch_us={F: 0.5, I: 0.5, W: 0.5})), [0, 1], 4)
    assert plain.optimal and slow.optimal
    assert plain.makespan_us == pytest.approx(3 * 4 + 1, abs=1e-4)  # the zero-bubble bound, 3m + (p - 1)
    assert slow.makespan_us == pytest.approx(1.5 * (3 * 4 + 1), abs=1e-4)  # every action half again as long
    assert slow.makespan_us == pytest.approx(slow.estimate.step_time_us, abs=1e-4)
    verify_plan(slow.plan)


def test_the_tuner_predicts_with_the_terms_its_profile_holds() -> None:
    names = [f"l{i}" for i in range(4)]
    profile = uniform_profile(names, num_ranks=2, forward_us=100.0, backward_input_us=100.0, backward_weight_us=100.0)
    config = TuneConfig(num_ranks=2, num_microbatches=4, time_budget_s=5.0)
    plain = tune(profile, config)
    profile.runtime.CopyFrom(RuntimeCosts(dispatch_us={F: 40.0, I: 40.0, W: 40.0, B: 40.0}).to_proto())
    costly = tune(profile, config)
    assert costly.estimate.step_time_us > plain.estimate.step_time_us
    # the tuned plan's estimate is the simulator's on the same profile's costs
    assert costly.estimate.step_time_us == pytest.approx(
        simulate(costly.plan, local_cost_model(costly.plan, profile)).estimate.step_time_us
    )
