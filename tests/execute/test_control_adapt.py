"""The closed loop: a run started with a poor schedule is re-tuned from its measured steps and switches
plans at a step boundary without restarting; every step's loss still equals the local launcher's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from octopipe.execute.control import LocalCluster
from octopipe.execute.control.client import ControlClient
from octopipe.execute.runtime import RunOptions, run_local
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from tests.execute.control_cluster import llama_plan
from tests.tune.test_retune import sequential as sequential_plan

pytestmark = pytest.mark.slow


def sequential(plan: plan_pb2.Plan) -> plan_pb2.Plan:
    """The same stages run one micro-batch at a time through the whole pipe: correct, and slow."""
    slow = sequential_plan(len(plan.ranks), plan.num_microbatches, [list(s.layer_names) for s in plan.stages])
    slow.model.CopyFrom(plan.model)
    return slow


def test_a_slow_plan_is_switched_at_a_step_boundary_and_losses_stay_exact(tmp_path: Path) -> None:
    plan = sequential(llama_plan(2, 4))
    # far more steps than it will run, so the closed loop's decision lands whenever the re-tune ends (a second or
    # more on a busy machine); the test cancels the run a few steps after the switch
    profile = profile_reference(plan.model, num_microbatches=plan.num_microbatches, repeats=2)
    with LocalCluster(tmp_path) as running, running.client() as client:
        running.add_node("node0")
        running.add_node("node1")
        run_id = client.submit(plan, steps=100_000, adapt_profile=profile, adapt_after_steps=3)
        switched_at = wait_for_switch(client, run_id)
        client.cancel(run_id, reason="switched and measured")
        run = client.wait(run_id, timeout_s=60)
        metrics = client.metrics(run_id)
    assert run.state == node_pb2.RUN_STATE_CANCELLED, run.error
    print(run.adapt_report)  # the closed loop's report, for the record (-s)
    assert "switching" in run.adapt_report, run.adapt_report
    assert "measured median step" in run.adapt_report, run.adapt_report
    assert run.plan_version == 2
    switches = {m.step: m.plan_switches for m in metrics if m.rank == 0}
    last = max(switches)
    assert last >= switched_at + 3
    # switched once, between steps: every step before the switch ran the first plan, every one after the second
    assert [switches[s] for s in range(last + 1)] == [0] * switched_at + [1] * (last + 1 - switched_at)
    losses = [m.loss for m in sorted(metrics, key=lambda m: m.step) if m.rank == 1 and m.has_loss]
    expected = run_local(plan, RunOptions(steps=len(losses), pin_cores=False)).losses
    assert losses == expected  # the new schedule computes the same bits


def wait_for_switch(client: ControlClient, run_id: str, *, after: int = 3, timeout_s: float = 240) -> int:
    """The first step rank 0 ran on the switched plan, once ``after`` more steps have run on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.run(run_id)
        ended = (node_pb2.RUN_STATE_DONE, node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_CANCELLED)
        assert run.state not in ended, (run.state, run.error)
        steps = {m.step: m.plan_switches for m in client.metrics(run_id, follow=False) if m.rank == 0}
        switched = [s for s, n in steps.items() if n == 1]
        if switched and max(steps) >= min(switched) + after:
            return min(switched)
        time.sleep(0.1)
    raise TimeoutError(f"run {run_id}: no plan switch with {after} steps after it within {timeout_s} s")
