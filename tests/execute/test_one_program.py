"""One program: the simulator, the verifier and the runtime run the same compiled plan.

* changing only the program (a receive posted later) moves the simulated and
  the executed post alike, and the channels run in the program's order;
* the runtime's channels complete strictly in issue order, as NCCL does: an
  order that gloo's tags would tolerate hangs there, so the verifier must (and
  does) refuse it before any rank starts;
* the launcher refuses every plan the verifier refuses.
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe.execute.runtime import Channels, CommTimeout, RunOptions, run_local_many
from octopipe.execute.runtime.comm import channel_groups, program_channels
from octopipe.execute.runtime.pipeline import tune_reference
from octopipe.ir import DeadlockError, PlanError, compile_plan, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import CostModel, Link, StageCost, local_cost_model, simulate, uniform_profile, verify_plan
from octopipe.tune import TuneConfig, one_f_one_b, zb_h1
from octopipe.tune.problem import Layers
from tests.execute.test_runtime import assert_bitwise, channel_order, make_plan
from tests.transform.gloo import run_ranks


def moved(plan: plan_pb2.Plan, rank: int, text: str, before: str) -> plan_pb2.Plan:
    """A copy of ``plan`` with ``rank``'s action ``text`` moved to just before its action ``before``."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    texts = [str(a) for a in rank_actions(plan)[rank]]
    actions = list(plan.ranks[rank].actions)
    item = actions.pop(texts.index(text))
    texts.remove(text)
    actions.insert(texts.index(before), item)
    del out.ranks[rank].actions[:]
    out.ranks[rank].actions.extend(actions)
    return out


@pytest.mark.slow
def test_a_receive_posted_later_moves_in_the_simulation_and_in_the_run() -> None:
    early = make_plan(one_f_one_b, "llama-8", 2, 4)
    # lowered: rank 1 posts 1RECV_F1 one message ahead, right after 1F0; move it to just before 1F1
    texts = [str(a) for a in rank_actions(early)[1]]
    assert texts.index("1RECV_F1") < texts.index("1B0")
    late = moved(early, 1, "1RECV_F1", "1F1")
    verify_plan(late)
    costs = CostModel.uniform(
        num_stages=2, stage=StageCost(forward_us=100, backward_input_us=200), link=Link(latency_us=50)
    )
    sims = [simulate(plan, costs) for plan in (early, late)]
    programs = [sim.program for sim in sims]
    transfer = [p.transfer_of[1][[str(a) for a in rank_actions(plan)[1]].index("1RECV_F1")] for p, plan in
                zip(programs, (early, late), strict=True)]  # fmt: skip
    posted = [sim.timing.posted_recv[t] for sim, t in zip(sims, transfer, strict=True)]
    b0_end = {t.action: t.end_us for t in sims[1].timeline(1)}["1B0"]
    assert posted[0] < b0_end <= posted[1]  # simulated: posted before 1B0, then after it
    runs = run_local_many([early, late], RunOptions(steps=2, keep_grads=True, timeout_s=120, pin_cores=False))
    for plan, program, run in zip((early, late), programs, runs, strict=True):
        for rank, steps in run.timelines.items():
            records = steps[-1].records
            assert [r.action for r in records] == [str(a) for a in rank_actions(plan)[rank]]
            # on the CPU the device's clock is the host's: each action's work is done when its call returns
            assert all((r.host_start_ns, r.host_end_ns) == (r.start_ns, r.end_ns) for r in records)
            assert steps[-1].start_ns <= records[0].start_ns <= records[-1].end_ns <= steps[-1].end_ns
            # every channel started its transfers in the program's order, every step (strict order)
            for channel, order in channel_order(program, rank).items():
                assert run.channels[rank][channel] == order * 2, (plan.name, rank, channel)
    for run, plan in zip(runs, (early, late), strict=True):  # executed: the post follows the program too
        records = run.timelines[1][-1].records
        index = [str(a) for a in rank_actions(plan)[1]].index("1RECV_F1")
        b0 = next(r for r in records if r.action == "1B0")
        assert (records[index].start_ns < b0.start_ns) == (plan is early)
    assert runs[0].losses == runs[1].losses
    assert_bitwise(runs[0].grads, runs[1].grads)


def test_an_order_nccl_cannot_run_is_refused_before_any_rank_starts() -> None:
    plan = make_plan(zb_h1, "llama-8", 2, 4)
    # rank 1 receives F0 and F1 from rank 0, which sends F0 first: posting 1RECV_F1 first would leave
    # each channel waiting for the other's head (NCCL completes a channel in issue order)
    texts = [str(a) for a in rank_actions(plan)[1]]
    assert texts.index("1RECV_F0") < texts.index("1RECV_F1")
    swapped = moved(plan, 1, "1RECV_F1", "1RECV_F0")
    with pytest.raises(DeadlockError) as caught:
        verify_plan(swapped)
    error = caught.value
    assert (error.rank, error.action) == (1, "1RECV_F1")
    assert error.step == [str(a) for a in rank_actions(swapped)[1]].index("1RECV_F1")
    assert "post the receives from rank 0 in the order that rank sends" in str(error)
    started = time.monotonic()
    with pytest.raises(DeadlockError, match=r"rank 1, step \d+ \(1RECV_F1\)"):
        run_local_many([swapped])
    assert time.monotonic() - started < 5  # refused statically: no rank was started


def _outcome(call: Callable[[], None]) -> str:
    """How a channel operation ended: "done", "timeout" (its own deadline passed), or "closed" (the peer's
    deadline passed first: gloo closes a context's connections when one of its operations times out)."""
    try:
        call()
    except CommTimeout:
        return "timeout"
    except RuntimeError as exc:
        if "closed by peer" not in str(exc).lower() and "connection reset" not in str(exc).lower():
            raise
        return "closed"
    return "done"


def _strict_channels(rank: int, world: int, swap: bool) -> None:
    """Rank 0 sends F0 then F1 to rank 1; rank 1 posts its receives in order, or swapped."""
    program = compile_plan(one_f_one_b(2, 2))
    store = dist.distributed_c10d._get_default_store()
    forward = [t for t in range(program.num_transfers) if program.sender[t][0] == 0]
    assert len(forward) == 2
    channels = Channels(
        program=program,
        rank=rank,
        buffer_spec=lambda t: (torch.Size([4]), torch.float32),
        timeout_s=3,
        aborted=lambda: None,
        groups=channel_groups(program_channels(program)),
    )
    if rank == 0:
        for transfer in forward:
            channels.send(transfer, torch.full((4,), float(transfer)))
        sent = _outcome(lambda: channels.finish("rank 0"))
        # stay until rank 1 is done: leaving would close the connection it waits on
        store.wait(["rank 1"], datetime.timedelta(seconds=60))
        received = store.get("rank 1").decode()
        if not swap:
            assert (sent, received) == ("done", "done")
        else:
            # neither side completed anything, and the hang was detected by a deadline (whichever passed
            # first; the other rank then sees its connection closed)
            assert "done" not in (sent, received), (sent, received)
            assert "timeout" in (sent, received), (sent, received)
        return
    order = forward[::-1] if swap else forward
    buffers = {t: channels.post_recv(t) for t in order}
    outcome = "error"
    try:
        outcome = _outcome(lambda: channels.wait(order[0], "rank 1"))
        if outcome == "done":
            assert not swap, "the receive posted first completed although the peer sends the other message first"
            channels.wait(order[1], "rank 1")
            assert all(torch.equal(buffers[t], torch.full((4,), float(t))) for t in order)
    finally:
        store.set("rank 1", outcome)


@pytest.mark.parametrize("swap", [False, True], ids=["in-order", "swapped"])
def test_channels_complete_strictly_in_issue_order_like_nccl(swap: bool) -> None:
    """gloo alone matches by tag and would deliver both; the runtime's channels hang as NCCL would."""
    run_ranks(_strict_channels, 2, swap, timeout_s=60)


def _mutations(plan: plan_pb2.Plan, seed: int) -> plan_pb2.Plan:
    """A random edit of one rank's program: move, drop or repeat one action."""
    rng = random.Random(seed)
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    program = out.ranks[rng.randrange(len(out.ranks))]
    actions = list(program.actions)
    index = rng.randrange(len(actions))
    edit = rng.choice(["move", "drop", "repeat"])
    item = actions[index]
    if edit == "drop":
        del actions[index]
    elif edit == "repeat":
        actions.insert(rng.randrange(len(actions) + 1), item)
    else:
        del actions[index]
        actions.insert(rng.randrange(len(actions) + 1), item)
    del program.actions[:]
    program.actions.extend(actions)
    return out


BASE = make_plan(zb_h1, "llama-8", 2, 3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_the_launcher_refuses_every_plan_the_verifier_refuses(seed: int) -> None:
    mutated = _mutations(BASE, seed)
    try:
        verify_plan(mutated)
    except PlanError as refusal:
        with pytest.raises(PlanError) as caught:
            run_local_many([mutated], RunOptions(timeout_s=5))
        assert str(caught.value) == str(refusal)  # the same check, the same message, before any rank starts
    # a plan the verifier accepts must run: test_a_plan_the_verifier_accepts_after_a_move_runs


@pytest.mark.slow
def test_a_plan_the_verifier_accepts_after_a_move_runs() -> None:
    """The other half of the property: a moved action the verifier accepts runs and equals the original."""
    accepted = None
    for seed in range(200):
        candidate = _mutations(BASE, seed)
        if candidate == BASE:
            continue
        try:
            verify_plan(candidate)
        except PlanError:
            continue
        accepted = candidate
        break
    assert accepted is not None
    runs = run_local_many([BASE, accepted], RunOptions(steps=1, keep_grads=True, timeout_s=120, pin_cores=False))
    assert runs[0].losses == runs[1].losses
    assert_bitwise(runs[0].grads, runs[1].grads)


def test_a_tuned_plan_means_the_same_to_the_tuner_and_the_verifier() -> None:
    """The tuner and ``local_cost_model`` sum stages and price links alike: a profile with no measured
    link is tuned for the local link the verifier checks with (it was tuned for a free link once, and a
    plan within its cap there went 3072 bytes over on the local link), and a layer's measured full
    backward (not I + W) prices B on both sides."""
    names = [f"layers.{i}" for i in range(8)]
    profile = uniform_profile(names, activation_bytes=4096, output_bytes=1024, parameter_bytes=512)
    assert not profile.links
    for index, layer in enumerate(profile.layers):
        layer.forward_duration_us = 40.0 * (1 + index % 3)
        layer.backward_input_duration_us = 50.0 * (1 + index % 3)
        layer.backward_weight_duration_us = 30.0 * (1 + index % 3)
        layer.full_backward_duration_us = 70.0 * (1 + index % 3)
        layer.activation_freed_by_backward_input_bytes = 1024
    for min_gain in (0.0, 0.5):  # the fastest plan, and 1F1B (B actions)
        tuned = tune_reference(profile, TuneConfig(num_ranks=2, num_microbatches=4, time_budget_s=2, min_gain=min_gain))
        assert min_gain == 0.0 or tuned.description.startswith("1f1b")
        checked = simulate(tuned.plan, local_cost_model(tuned.plan, profile)).estimate  # enforces the caps
        assert checked.step_time_us == tuned.estimate.step_time_us
        assert [r.peak_memory_bytes for r in checked.ranks] == [r.peak_memory_bytes for r in tuned.estimate.ranks]
        stages = local_cost_model(tuned.plan, profile).stages
        sizes = [len(stage.layer_names) for stage in tuned.plan.stages]
        bounds = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
        layers = Layers.from_profile(profile)
        assert [layers.stage_cost(bounds[s], bounds[s + 1]) for s in range(len(sizes))] == list(stages)
