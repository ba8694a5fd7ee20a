"""A coordinator and two node daemons on loopback run a plan; losses equal the local launcher's."""

from __future__ import annotations

from pathlib import Path

import pytest

from octopipe.execute.control import LocalCluster
from octopipe.execute.control.local import result_from_metrics
from octopipe.execute.runtime import reference_run
from octopipe.node.v1 import node_pb2
from tests.execute.control_cluster import llama_plan

pytestmark = pytest.mark.slow


@pytest.mark.extended  # CI's budget (16 s): test_control_operator and test_control_faults run plans on daemons
def test_two_daemons_run_a_plan_like_the_local_launcher(tmp_path: Path) -> None:
    plan = llama_plan()
    # the local launcher's losses are bitwise the single process's (test_runtime): the daemons' must be too
    expected = reference_run(plan.model, num_microbatches=plan.num_microbatches, steps=3).losses
    with LocalCluster(tmp_path) as running, running.client() as client:
        running.add_node("node0")
        running.add_node("node1")
        run_id = client.submit(plan, steps=3)
        run = client.wait(run_id, timeout_s=120)
        assert run.state == node_pb2.RUN_STATE_DONE, run.error
        assert run.completed_steps == 3
        assert list(run.rank_nodes) == ["node0", "node1"]
        metrics = client.metrics(run_id)
    last_rank = plan.stages[-1].rank
    losses = [m.loss for m in sorted(metrics, key=lambda m: m.step) if m.rank == last_rank]
    assert losses == expected  # bitwise: the same ops in the same order
    assert {(m.rank, m.step) for m in metrics} == {(r, s) for r in (0, 1) for s in range(3)}
    assert all(m.timeline.records for m in metrics)
    # the same run as a RunResult, like the local launcher's
    rebuilt = result_from_metrics(plan, metrics)
    assert rebuilt.losses == expected
    assert sorted(rebuilt.timelines) == [0, 1] and all(len(steps) == 3 for steps in rebuilt.timelines.values())
    first = rebuilt.timelines[0][0]
    assert first.start_ns <= first.records[0].start_ns <= first.records[-1].end_ns
