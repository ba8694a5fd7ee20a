"""The runtime on real gloo processes: every rank's gradients, losses and updated weights equal the eager reference."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable

import pytest
import torch

from octopipe.execute.runtime import (
    RunFailed,
    RunOptions,
    build_model,
    reference_run,
    run_local,
    run_local_many,
    workload_reference,
)
from octopipe.execute.runtime.interop import torch_schedule_plan
from octopipe.execute.runtime.launcher import _no_message
from octopipe.ir import Action, ActionKind, Program, StageSpec, add_p2p_actions, build_plan, compile_plan, rank_actions
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import uniform_profile
from octopipe.tune import (
    TuneConfig,
    dualpipe_v,
    equal_partition,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    tune,
    v_half,
    v_min,
    zb_h1,
    zb_h2,
    zb_v,
)

pytestmark = pytest.mark.slow


def make_plan(
    schedule: Callable[..., plan_pb2.Plan], workload: str, ranks: int, m: int, **config: object
) -> plan_pb2.Plan:
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=2 * m, **config)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = schedule(ranks, m, layer_names=equal_partition(names, ranks))
    plan.model.CopyFrom(reference)
    return plan


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max |diff| {(actual[name] - value).abs().max().item()}"


def channel_order(program: Program, rank: int) -> dict[str, list[int]]:
    """Each channel of ``rank`` -> its transfers in program order (what the runtime must start, in order)."""
    out: dict[str, list[int]] = {}
    for step, transfer in enumerate(program.transfer_of[rank]):
        if transfer < 0:
            continue
        sending = program.sender[transfer] == (rank, step)
        peer = program.receiver[transfer][0] if sending else program.sender[transfer][0]
        out.setdefault(f"{'send' if sending else 'recv'} {peer}", []).append(transfer)
    return out


def overlapped_1f1b(ranks: int, m: int, *, layer_names: list[list[str]]) -> plan_pb2.Plan:
    """1F1B whose steady state runs each (B of one micro-batch, F of the next) as one OVERLAP_F_B."""
    base = rank_actions(one_f_one_b(ranks, m, layer_names=layer_names))
    compute: dict[int, list[Action]] = {}
    for rank, actions in base.items():
        plain = [a for a in actions if a.kind.is_compute]
        merged: list[Action] = []
        index = 0
        while index < len(plain):
            pair = plain[index : index + 2]
            if len(pair) == 2 and pair[0].kind is ActionKind.FULL_BACKWARD and pair[1].kind is ActionKind.FORWARD:
                merged.append(Action(ActionKind.OVERLAP_F_B, sub_actions=(pair[1], pair[0])))
                index += 2
            else:
                merged.append(plain[index])
                index += 1
        compute[rank] = merged
    stages = [StageSpec(rank=s, layer_names=tuple(names)) for s, names in enumerate(layer_names)]
    placement = {s: s for s in range(ranks)}
    return build_plan(
        stages=stages, actions=add_p2p_actions(compute, placement), num_microbatches=m, name="1f1b-overlap"
    )


def tuned(names: list[str], ranks: int, m: int) -> plan_pb2.Plan:
    """What the co-optimizer makes of a heterogeneous profile: uneven stages, any schedule it likes."""
    profile = uniform_profile(names, num_ranks=ranks, activation_bytes=1 << 20, output_bytes=1 << 16)
    for index, layer in enumerate(profile.layers):  # every third layer three times as slow (a Mamba among MLPs)
        if index % 3 == 1:
            layer.forward_duration_us *= 3
            layer.backward_input_duration_us *= 3
            layer.backward_weight_duration_us *= 3
    return tune(profile, TuneConfig(num_ranks=ranks, num_microbatches=m, time_budget_s=10)).plan


def library(workload: str, ranks: int, m: int) -> list[plan_pb2.Plan]:
    """Every schedule the runtime must run, for one model and rank count."""
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=2 * m)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    per_rank = equal_partition(names, ranks)
    per_chunk = equal_partition(names, 2 * ranks)
    plans = [
        gpipe(ranks, m, layer_names=per_rank),
        one_f_one_b(ranks, m, layer_names=per_rank),
        zb_h1(ranks, m, layer_names=per_rank),
        interleaved_1f1b(ranks, 2, m, layer_names=per_chunk),
        overlapped_1f1b(ranks, m, layer_names=per_rank),
        zb_h2(ranks, m, layer_names=per_rank),
        zb_v(ranks, m, layer_names=per_chunk),
        v_half(ranks, m, layer_names=per_chunk),
        v_min(ranks, m, layer_names=per_chunk),
        dualpipe_v(ranks, m, layer_names=per_chunk),
        tuned(names, ranks, m),
        # torch's own orders, imported: V-shaped zero bubble, and DualPipeV with OVERLAP_F_B
        torch_schedule_plan("ScheduleZBVZeroBubble", num_ranks=ranks, num_microbatches=m, layer_names=per_chunk),
        torch_schedule_plan("ScheduleDualPipeV", num_ranks=ranks, num_microbatches=m, layer_names=per_chunk),
        torch_schedule_plan(
            "ScheduleInterleavedZeroBubble", num_ranks=ranks, num_microbatches=m, layer_names=per_chunk
        ),
    ]
    for plan in plans:
        plan.model.CopyFrom(reference)
    return plans


@pytest.mark.parametrize(
    ("workload", "ranks"),
    [
        # llama-8 on 2 ranks is run bitwise by test_one_program, test_precision and test_training by default
        pytest.param("llama-8", 2, marks=pytest.mark.extended),
        # the MoE decoder runs by default as pp=2 x dp=2 x ep=2 in test_mesh_runtime (CI's budget)
        pytest.param("moe-ep-4", 2, marks=pytest.mark.extended),
        ("jamba-8", 2),
        # 4 ranks on 2 cores are slow (35-60 s each): extended; the quick loop has 4-rank meshes
        pytest.param("llama-8", 4, marks=pytest.mark.extended),
        pytest.param("jamba-8", 4, marks=pytest.mark.extended),
        pytest.param("nemotronh-16", 4, marks=pytest.mark.extended),
    ],
)
def test_every_schedule_equals_the_reference_bitwise(workload: str, ranks: int) -> None:
    """Loss and every gradient after one step, and every weight after three AdamW steps."""
    plans = library(workload, ranks, 2 * ranks)
    runs = run_local_many(plans, RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=120))
    ref = reference_run(plans[0].model, num_microbatches=2 * ranks, steps=3)
    for plan, run in zip(plans, runs, strict=True):
        assert run.losses == pytest.approx(ref.losses, rel=1e-6), plan.name
        assert_bitwise(ref.grads, run.grads)
        assert_bitwise(ref.params, run.params)
        program = compile_plan(plan)
        for rank, steps in run.timelines.items():
            assert len(steps) == 3
            assert [r.action for r in steps[0].records] == [str(a) for a in rank_actions(plan)[rank]]
            # strict order (as NCCL): every channel started its transfers in the program's order, every step
            for channel, order in channel_order(program, rank).items():
                assert run.channels[rank][channel] == order * 3, (plan.name, rank, channel)


def test_a_failing_rank_stops_every_rank_with_its_error() -> None:
    plan = make_plan(one_f_one_b, "llama-8", 2, 4)
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"rank 0, step 1, action 2 \(0SEND_F0\): injected failure after 3 actions"):
        run_local(plan, RunOptions(steps=2, timeout_s=30, fail_at={0: (1, 3)}))
    assert time.monotonic() - started < 30 + 15  # the other rank does not hang


def test_a_rank_killed_by_a_signal_is_named_with_the_signal() -> None:
    """A rank that dies natively (glibc's abort on heap corruption, a segfault) writes no error file: the
    failure names the process and its signal, not only 'died without a message'."""
    context = multiprocessing.get_context("spawn")
    aborted = context.Process(target=os.abort, name="octopipe-rank0")
    finished = context.Process(target=int, name="octopipe-rank1")
    for process in (aborted, finished):
        process.start()
        process.join(60)
    assert aborted.exitcode == -signal.SIGABRT and finished.exitcode == 0
    message = _no_message([aborted, finished])
    assert "octopipe-rank0 by SIGABRT" in message and "rank1" not in message
    assert _no_message([finished]) == "a rank died without a message"
