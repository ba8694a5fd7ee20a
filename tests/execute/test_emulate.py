"""Emulated execution: the real runtime (one interpreter, real channels and gloo messages) with every computation
waiting for its profiled duration, so 4-rank plans run on a 2-core machine (``runtime.emulate``)."""

from __future__ import annotations

import ast
import ctypes
import sys
import time
from pathlib import Path

import pytest
import torch

from octopipe.execute.runtime import RunOptions, emulation_problem, run_local
from octopipe.execute.runtime.emulate import emulated_stages, tighten_timer_slack
from octopipe.ir import ActionKind, compile_plan, parse_action
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import local_cost_model, simulate, uniform_profile
from octopipe.tune import dualpipe_v, one_f_one_b, zb_h1
from tests.execute.test_runtime import channel_order

pytestmark = pytest.mark.slow

RUNTIME = Path(__file__).parents[2] / "packages" / "execute" / "src" / "octopipe" / "execute" / "runtime"
ACTIVATION = 8 << 20  # bytes F saves per micro-batch and stage: large beside the 64 KiB boundary
BOUNDARY = 64 << 10


def named(stages: int) -> list[list[str]]:
    """One layer per stage."""
    return [[f"layers.{s}"] for s in range(stages)]


def profile_for(plan: plan_pb2.Plan, us: float = 4000.0) -> profile_pb2.Profile:
    """Every layer 4 ms per F, I and W; 8 MiB saved by F, half freed by I; a 64 KiB boundary; the local link."""
    return uniform_profile(
        plan,
        forward_us=us,
        backward_input_us=us,
        backward_weight_us=us,
        activation_bytes=ACTIVATION,
        freed_by_backward_input_bytes=ACTIVATION // 2,
        output_bytes=BOUNDARY,
        latency_us=100.0,
        bandwidth_bytes_per_second=3e9,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "dualpipe-v"])
def test_an_emulated_four_rank_plan_runs_its_program_on_two_cores(schedule: str) -> None:
    m = 8
    generators = {"1f1b": one_f_one_b, "zb-h1": zb_h1, "dualpipe-v": dualpipe_v}  # dualpipe-v: OVERLAP_F_B units
    stages = 8 if schedule == "dualpipe-v" else 4  # V placement: two stages per rank
    plan = generators[schedule](4, m, layer_names=named(stages))
    profile = profile_for(plan)
    result = run_local(plan, RunOptions(steps=2, timeout_s=60, emulate=profile))
    assert result.emulated
    assert not result.grads and not result.params  # nothing was computed
    program = compile_plan(plan)
    costs = local_cost_model(plan, profile)
    for rank in range(4):
        # every channel started its transfers in the program's order, every step
        expected = channel_order(program, rank)
        assert result.channels[rank] == {key: order * 2 for key, order in expected.items()}
        for timeline in result.timelines[rank]:
            # every action of the program recorded, in program order
            assert [r.action for r in timeline.records] == [str(a) for a in program.actions(rank)]
            for record in timeline.records:
                action = parse_action(record.action)
                if action.kind is ActionKind.OVERLAP_F_B:
                    forward, backward = action.sub_actions
                    least = costs.overlap_us(forward.stage, backward.stage, backward.kind)
                elif action.kind.is_compute:
                    least = costs.duration_us(action.stage, action.kind)
                else:
                    continue
                # a computation waits until its profiled duration has passed (a lower bound, never a speed claim)
                assert (record.end_ns - record.start_ns) / 1e3 >= least, record
    if schedule == "1f1b":  # the interpreter's memory accounting: rank r holds min(p - r, m) micro-batches' F
        for rank in range(4):
            peak = max(r.held_bytes for t in result.timelines[rank] for r in t.records)
            activations = min(4 - rank, m) * ACTIVATION
            assert activations <= peak <= activations + 4 * m * BOUNDARY, (rank, peak)
    predicted = simulate(plan, costs).estimate.step_time_us
    assert predicted > 0


def test_emulation_refuses_what_it_cannot_run_and_says_how_many_ranks_fit() -> None:
    plan = one_f_one_b(16, 32, layer_names=named(16))
    profile = profile_for(plan)
    problem = emulation_problem([plan], profile, RunOptions(), available_bytes=2 << 30)
    # 16 x 450 MiB per rank process + 2 x 15 x 32 messages of 64 KiB, against 80% of 2 GiB
    assert "emulating 16 ranks needs about 7.1 GiB" in problem and "at most 3 ranks fit" in problem, problem
    assert emulation_problem([plan], profile, RunOptions(), available_bytes=64 << 30) == ""
    lacking = uniform_profile(["layers.0"], num_ranks=16)
    assert "has no cost for layer(s)" in emulation_problem([plan], lacking, RunOptions(), available_bytes=64 << 30)
    with pytest.raises(ValueError, match="emulated runs compute nothing, so they take no keep_grads"):
        run_local(plan, RunOptions(keep_grads=True, emulate=profile))


def test_emulated_and_real_runs_share_the_one_interpreter() -> None:
    """Only the interpreter walks a program's actions and waits for its transfers; emulation hands it stages."""
    walkers = []
    for path in sorted(RUNTIME.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("transfers_waited", "post_recv_all", "send_all"):
                walkers.append((path.name, node.attr))
    assert {name for name, _ in walkers} <= {"interpreter.py", "comm.py"}, walkers
    emulate = ast.parse((RUNTIME / "emulate.py").read_text())
    calls = {n.func.id for n in ast.walk(emulate) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "RankRuntime" in calls  # the emulated path runs the interpreter itself
    assert not any(isinstance(n, ast.For) and "actions" in ast.unparse(n.iter) for n in ast.walk(emulate))


def test_an_emulated_stage_holds_the_profiled_bytes_and_waits_its_profiled_time() -> None:
    plan = zb_h1(2, 2, layer_names=named(2))
    costs = local_cost_model(plan, profile_for(plan, us=2000.0))
    stages = emulated_stages(compile_plan(plan), costs, 1)
    (last,) = stages.values()
    assert last.last and not last.first and last.graphs.input_requires_grad == (True, False)
    started = time.perf_counter_ns()
    (loss,), ctx = last.forward_all([torch.zeros(1), torch.zeros(1)])
    assert (time.perf_counter_ns() - started) / 1e3 >= 2000.0 and loss.dim() == 0
    assert ctx.saved is not None and [t.nbytes for t in ctx.saved] == [ACTIVATION]
    grads, wctx = last.backward_input_all(ctx, [torch.ones(())])
    assert ctx.saved is None  # I frees what only it needed ...
    assert [t.nbytes for t in wctx.tensors or []] == [ACTIVATION // 2]  # ... and keeps W's half
    assert grads[1] is None and grads[0] is not None and grads[0].nbytes == BOUNDARY  # sent back: stage 0's output
    assert last.backward_weight(wctx) == [] and wctx.tensors is None


def test_emulated_computations_sleep_with_a_tight_timer_slack() -> None:
    """On Linux the program thread's sleeps wake within 1 ns of the deadline (PR_SET_TIMERSLACK), so an
    emulated computation is not a 50 us slack longer than its profile says; elsewhere nothing is asked."""
    assert tighten_timer_slack() is sys.platform.startswith("linux")
    if sys.platform.startswith("linux"):
        assert ctypes.CDLL(None).prctl(30, 0, 0, 0, 0) == 1  # PR_GET_TIMERSLACK: this thread's slack, in ns
