"""Memory measured by the allocator, not by the runtime's own count (issue 15): checked against a hand count.

The model (tests/execute/memory_model.py): two bias-free 16 x 16 linear layers, one per stage, loss
``mean(output * target)``; a micro-batch is 2048 x 16 float32, A = 128 KiB. On the last stage one micro-batch
allocates: its received input (A, held until its backward is done: the weight gradient needs it), and inside
F the layer's output and ``output * target`` (A each, freed before F ends); inside B the output's gradient
``target / n`` and the input gradient it sends back (A each), and the 16 x 16 weight gradient. Nothing else
is of size A: the targets are views of the step's batch, built before the step.
"""

from __future__ import annotations

import pytest

from octopipe.execute.runtime import RunOptions, run_local_many
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import gpipe, one_f_one_b

A = 2048 * 16 * 4
WEIGHT = 16 * 16 * 4


@pytest.mark.slow
def test_allocator_peak_of_the_last_stage_equals_the_hand_count() -> None:
    m = 4
    model = plan_pb2.ModelReference(
        name="stack", source="tests.execute.memory_model:linear_stack", config={"layers": "2", "rows": str(2048 * m)}
    )
    plans = [schedule(2, m, layer_names=[["layers.0"], ["layers.1"]]) for schedule in (gpipe, one_f_one_b)]
    for plan in plans:
        plan.model.CopyFrom(model)
    gpipe_run, one_f_one_b_run = run_local_many(plans, RunOptions(steps=1, measure_memory=True, timeout_s=120))
    for run in (gpipe_run, one_f_one_b_run):
        for rank in (0, 1):
            # held when the step starts: the weight and AdamW's two moments (+ its 4-byte step count)
            assert run.memory[rank]["resident_bytes"] == 3 * WEIGHT + 4
            assert run.memory[rank]["step_end_bytes"] == WEIGHT  # the accumulated gradient outlives the step
    # GPipe: all m inputs are held when the last forward's two intermediates (or the first backward's two
    # gradients) are: (m + 2) A, plus the weight gradient and a few loss scalars
    last = gpipe_run.memory[1]["step_peak_bytes"]
    assert (m + 2) * A + WEIGHT <= last <= (m + 2) * A + WEIGHT + 4096, last / A
    # 1F1B: one input in use and the next one's receive posted ahead, plus the two intermediates; and one A
    # more when the previous micro-batch's input gradient is still on its way (a send holds its tensor until
    # the transfer ends, as the simulator counts it): on 2 busy cores its channel thread may not have run yet
    last = one_f_one_b_run.memory[1]["step_peak_bytes"]
    assert 4 * A + WEIGHT <= last <= 5 * A + WEIGHT + 4096, last / A
    assert (
        gpipe_run.memory[1]["peak_bytes"]
        == gpipe_run.memory[1]["resident_bytes"] + (gpipe_run.memory[1]["step_peak_bytes"])
    )
