"""Pinning that holds: ranks run on distinct cores even when their parent is pinned to one (issue 15)."""

from __future__ import annotations

import os

import pytest

from octopipe.execute.runtime import RunOptions, run_local
from octopipe.execute.runtime.pinning import online_cpus, shared_cores
from octopipe.tune import one_f_one_b
from tests.execute.test_runtime import make_plan


def test_online_cpus_and_shared_cores() -> None:
    cpus = online_cpus()
    assert cpus and cpus == sorted(set(cpus))
    assert shared_cores(len(cpus), cpus) == ""
    assert "3 ranks on 2 cores ([0, 1])" in shared_cores(3, [0, 1])


@pytest.mark.slow
@pytest.mark.skipif(len(online_cpus()) < 2, reason="needs two cores")
def test_ranks_take_distinct_cores_from_a_parent_pinned_to_one() -> None:
    inherited = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(inherited)})  # as a benchmark that pins itself before it starts the ranks
    try:
        run = run_local(make_plan(one_f_one_b, "llama-8", 2, 2), RunOptions(steps=1, timeout_s=60))
    finally:
        os.sched_setaffinity(0, inherited)
    assert sorted(run.cores) == [0, 1]
    assert all(len(cores) == 1 for cores in run.cores.values())
    assert run.cores[0] != run.cores[1]


def test_strict_pinning_refuses_ranks_that_would_share_a_core() -> None:
    plan = make_plan(one_f_one_b, "llama-8", 2, 2)
    with pytest.raises(ValueError, match=r"2 ranks on 1 cores \(\[0\]\).* drop strict pinning"):
        run_local(plan, RunOptions(cpus=[0], strict_pinning=True))
