"""The closed loop: a run started with a poor schedule is re-tuned from its measured steps and switches
plans at a step boundary without restarting; every step's loss still equals the local launcher's."""

from __future__ import annotations

from pathlib import Path

import pytest

from octopipe.execute.control import LocalCluster
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
    # the closed loop decides while the run goes on (a 2-rank tiny step takes ~40 ms; its re-tune a second or
    # more on a busy machine): enough steps that the switch lands with steps left to measure after it
    steps = 64
    expected = run_local(plan, RunOptions(steps=steps, pin_cores=False)).losses
    profile = profile_reference(plan.model, num_microbatches=plan.num_microbatches, repeats=2)
    with LocalCluster(tmp_path) as running, running.client() as client:
        running.add_node("node0")
        running.add_node("node1")
        run_id = client.submit(plan, steps=steps, adapt_profile=profile, adapt_after_steps=3)
        run = client.wait(run_id, timeout_s=240)
        metrics = client.metrics(run_id)
    assert run.state == node_pb2.RUN_STATE_DONE, run.error
    print(run.adapt_report)  # the closed loop's report, for the record (-s)
    assert "switching" in run.adapt_report, run.adapt_report
    assert "measured median step" in run.adapt_report, run.adapt_report
    assert run.plan_version == 2
    switches = {m.step: m.plan_switches for m in metrics if m.rank == 0}
    assert switches[0] == 0 and switches[steps - 1] == 1  # switched once, between steps
    losses = [m.loss for m in sorted(metrics, key=lambda m: m.step) if m.rank == 1]
    assert losses == expected  # the new schedule computes the same bits
