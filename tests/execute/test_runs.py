"""The torch-free run types: RunOptions validation, WorkerConfig.for_rank, and the StepTimeline round trips."""

from __future__ import annotations

import pytest

from octopipe.execute.runs import ActionRecord, RunOptions, StepTimeline, WorkerConfig


def test_run_options_refuse_what_cannot_run_and_say_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"steps must be >= 0, got -1; timeout_s must be > 0, got 0"):
        RunOptions(steps=-1, timeout_s=0)
    with pytest.raises(ValueError, match=r"cpus must be core numbers >= 0, got \[0, -2\]"):
        RunOptions(cpus=[0, -2])
    with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
        RunOptions(checkpoint_every=2)
    with pytest.raises(ValueError, match="resume needs the checkpoint_dir"):
        RunOptions(resume=True)
    assert RunOptions(steps=0).steps == 0  # a run resumed from its last step's checkpoint has nothing left
    assert RunOptions(cpus=[3, 1]).cpus == (3, 1)


def test_a_worker_config_is_the_options_for_one_rank() -> None:
    options = RunOptions(steps=4, seed=7, keep_grads=True, fail_at={1: (2, 3)}, cpus=[0, 1])
    common = {"plans": [b"p"], "world_size": 2, "store_host": "h", "store_port": 9, "result_dir": "d"}
    first, second = (WorkerConfig.for_rank(options, rank=r, **common) for r in (0, 1))  # type: ignore[arg-type]
    assert (first.rank, first.fail_at, second.fail_at) == (0, None, (2, 3))
    assert (second.steps, second.seed, second.keep_grads, second.cpus, second.plans) == (4, 7, True, (0, 1), (b"p",))
    assert not second.die_with_parent and not second.adaptive and not second.store_is_master


def test_a_step_timeline_survives_the_result_file_and_the_proto() -> None:
    records = (
        ActionRecord(action="0F0", stream="compute", start_ns=1_000, end_ns=4_000, held_bytes=64, rss_bytes=9),
        ActionRecord(action="0SEND_F0", stream="send", start_ns=4_000, end_ns=6_500, held_bytes=32),
    )
    step = StepTimeline(rank=0, step=3, start_ns=500, end_ns=7_000, records=records, loss=1.5, plan_switches=1)
    assert StepTimeline.from_dict(step.as_dict()) == step
    proto = step.to_proto()
    assert (proto.rank, proto.step, proto.peak_memory_bytes) == (0, 3, 64)
    assert [(r.start_us, r.end_us) for r in proto.records] == [(0.5, 3.5), (3.5, 6.0)]
    back = StepTimeline.from_proto(proto, start_ns=500, duration_us=6.5)
    assert [r.action for r in back.records] == ["0F0", "0SEND_F0"]
    assert (back.start_ns, back.end_ns, back.records[1].end_ns) == (500, 7_000, 6_500)
