"""Fuzzing the Plan and Profile entry points: a few thousand hostile inputs, no crash, no hang.

A Plan from the network goes through ``check_plan`` (what SubmitPlan and ResumeRun run); a Profile goes
through the simulator's ``simulate`` (what ``octopipe simulate``/``tune`` and the closed loop run). Each
input must give an answer or a ValueError with a message, within a deadline per example."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.control import LocalCluster, check_plan
from octopipe.ir import action_to_proto, parse_action
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import simulate
from octopipe.tune import equal_partition, one_f_one_b, zb_h1
from tests.simulate.strategies import plans

FUZZ = settings(max_examples=1500, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _valid_plan() -> plan_pb2.Plan:
    plan = one_f_one_b(2, 4, layer_names=equal_partition([f"layers.{i}" for i in range(4)], 2))
    plan.model.name, plan.model.source = "llama-8", "octopipe.examples:workload"
    return plan


@st.composite
def mutated_plans(draw: st.DrawFn) -> plan_pb2.Plan:
    """A valid plan with a few random edits: actions dropped, duplicated, moved or rewritten; fields changed."""
    plan = _valid_plan()
    for _ in range(draw(st.integers(1, 4))):
        program = plan.ranks[draw(st.integers(0, len(plan.ranks) - 1))]
        edit = draw(st.sampled_from(["drop", "dup", "move", "rewrite", "stage", "mb", "mesh", "rank"]))
        count = len(program.actions)
        if edit == "drop" and count:
            del program.actions[draw(st.integers(0, count - 1))]
        elif edit == "dup" and count:
            program.actions.append(program.actions[draw(st.integers(0, count - 1))])
        elif edit == "move" and count > 1:
            i, j = draw(st.integers(0, count - 1)), draw(st.integers(0, count - 1))
            a, b = plan_pb2.Action(), plan_pb2.Action()
            a.CopyFrom(program.actions[i])
            b.CopyFrom(program.actions[j])
            program.actions[i].CopyFrom(b)
            program.actions[j].CopyFrom(a)
        elif edit == "rewrite" and count:
            code = draw(
                st.sampled_from(["0F0", "1I3", "0W2", "1B1", "0SEND_F1", "1RECV_B0", "0UNSHARD", "1REDUCE_GRAD"])
            )
            program.actions[draw(st.integers(0, count - 1))].CopyFrom(action_to_proto(parse_action(code)))
        elif edit == "stage":
            plan.stages[draw(st.integers(0, 1))].rank = draw(st.integers(0, 2**32 - 1))
        elif edit == "mb":
            plan.num_microbatches = draw(st.integers(0, 2**32 - 1))
        elif edit == "mesh":
            plan.mesh.dp, plan.mesh.ep = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 64))
        elif edit == "rank":
            program.rank = draw(st.integers(0, 2**32 - 1))
    return plan


def _answers(plan: plan_pb2.Plan) -> None:
    problem = check_plan(plan, num_steps=3)
    assert isinstance(problem, str)


@FUZZ
@given(plans())
def test_random_plans_get_an_answer(plan: plan_pb2.Plan) -> None:
    _answers(plan)


@FUZZ
@given(mutated_plans())
def test_mutated_plans_get_an_answer(plan: plan_pb2.Plan) -> None:
    _answers(plan)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_are_refused(data: bytes) -> None:
    try:
        plan = plan_pb2.Plan.FromString(data)
    except DecodeError:
        return
    _answers(plan)


finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)
hostile = st.one_of(finite, st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308]))


@st.composite
def profiles(draw: st.DrawFn) -> profile_pb2.Profile:
    profile = profile_pb2.Profile(microbatch_size=draw(st.integers(0, 2**32 - 1)))
    names = [f"layers.{i}" for i in range(4)]
    for name in draw(st.lists(st.sampled_from([*names, "other"]), max_size=6)):
        profile.layers.add(
            layer_name=name,
            forward_duration_us=draw(hostile),
            backward_input_duration_us=draw(hostile),
            backward_weight_duration_us=draw(hostile),
            activation_saved_bytes=draw(st.integers(0, 2**64 - 1)),
            parameter_bytes=draw(st.integers(0, 2**40)),
        )
    for _ in range(draw(st.integers(0, 3))):
        profile.links.add(
            source_rank=draw(st.integers(0, 3)),
            destination_rank=draw(st.integers(0, 3)),
            latency_us=draw(hostile),
            bandwidth_bytes_per_second=draw(hostile),
        )
    return profile


@FUZZ
@given(profiles(), st.booleans())
def test_random_profiles_simulate_or_are_refused(profile: profile_pb2.Profile, split: bool) -> None:
    names = equal_partition([f"layers.{i}" for i in range(4)], 2)
    plan = (zb_h1 if split else one_f_one_b)(2, 4, layer_names=names)
    try:
        result = simulate(plan, profile)
    except ValueError as exc:
        assert str(exc)
        return
    assert result.estimate.step_time_us >= 0 and math.isfinite(result.estimate.step_time_us)


@pytest.mark.slow
def test_the_coordinator_answers_every_fuzzed_submission(tmp_path) -> None:  # type: ignore[no-untyped-def]

    samples: list[plan_pb2.Plan] = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.one_of(plans(), mutated_plans()))
    def collect(plan: plan_pb2.Plan) -> None:
        samples.append(plan)

    collect()
    with LocalCluster(tmp_path) as running, running.client() as client:
        for index, plan in enumerate(samples):
            stub_request = coordinator_pb2.SubmitPlanRequest(plan=plan, num_steps=1, run_id=f"fuzz{index}")
            try:
                client._stub.SubmitPlan(stub_request, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
                assert exc.details()
        client.runs()  # still serving
