"""pp x dp (x ep) meshes on real gloo processes: pp=2 x dp=2 on 4 CPU ranks equals the single-process reference.

Every stage is FSDP-sharded over its dp group (UNSHARD / REDUCE_GRAD / RESHARD
actions run the graphs split out of the captured stage); MoE experts are split
over the ep group (all-to-all inside the graphs). The reference is one process
running the same global batch as dp*m micro-batches (replica d's micro-batch j
is the reference's micro-batch d*m + j), each loss scaled by 1/(dp*m).

Not bitwise, so ``assert_close`` at fp32 tolerances: gradients are summed over
micro-batches on each replica and then averaged over replicas by the
reduce-scatter (the reference sums all dp*m micro-batches in one order), and an
expert's batched matmul sees a different number of slots with expert
parallelism. AdamW on a shard is AdamW on those elements of the full tensor, so
weights after 3 steps compare the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from octopipe.capture import StageGraphs, split_model
from octopipe.execute.runtime import (
    Channels,
    RankRuntime,
    RunOptions,
    RunResult,
    build_model,
    reference_run,
    run_local_many,
    workload_reference,
)
from octopipe.execute.runtime.mesh import MeshRank, replica_batch
from octopipe.ir import (
    ActionCountError,
    MissingInputError,
    PlanError,
    StageSpec,
    VerificationError,
    action_to_proto,
    build_plan,
    compile_plan,
    rank_actions,
    with_collectives,
)
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import BWSplit, StageExecutable, compile_stage
from octopipe.tune import (
    CollectivePlacement,
    equal_partition,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    place_collectives,
    zb_h1,
)
from tests.execute.test_runtime import overlapped_1f1b

DP = 2
M = 4
#: the runtime tests' placement: UNSHARD one compute action ahead of the stage's first use, RESHARD after its last
AHEAD = CollectivePlacement(prefetch=False, ahead=1, reshard=True)


def mesh_plans(workload: str, *, ep: int) -> list[plan_pb2.Plan]:
    """1F1B, ZB-H1 (I/W split), interleaved 1F1B (two stages per rank) and 1F1B with OVERLAP_F_B (multiplexed
    graphs over gathered parameters) on pp=2 x dp=2, with FSDP actions."""
    reference = workload_reference(workload, tiny=True, sequence=8, global_batch=DP * M)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plans = [
        one_f_one_b(2, M, layer_names=equal_partition(names, 2)),
        zb_h1(2, M, layer_names=equal_partition(names, 2)),
        interleaved_1f1b(2, 2, M, layer_names=equal_partition(names, 4)),
        overlapped_1f1b(2, M, layer_names=equal_partition(names, 2)),
    ]
    out = []
    for plan in plans:
        plan.model.CopyFrom(reference)
        plan.mesh.dp = DP
        plan.mesh.ep = ep
        out.append(with_collectives(plan, AHEAD))
    return out


def assert_tensors_close(
    plan: str, what: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]
) -> None:
    """The same names, shapes, and values within fp32 tolerance (``assert_close``'s defaults)."""
    assert sorted(actual) == sorted(expected), plan
    for name, value in expected.items():
        assert actual[name].shape == value.shape, (plan, name)
        torch.testing.assert_close(
            actual[name],
            value,
            msg=lambda m, n=name: f"{plan}: {what} {n}: {m}",  # type: ignore[misc]
        )


def assert_matches_reference(
    plans: Sequence[plan_pb2.Plan], runs: Sequence[RunResult], *, dp: int = DP, m: int = M
) -> None:
    ref = reference_run(plans[0].model, num_microbatches=m * dp, steps=3)
    for plan, run in zip(plans, runs, strict=True):
        assert run.losses == pytest.approx(ref.losses, rel=1e-6), plan.name
        assert_tensors_close(plan.name, "grad", ref.grads, run.grads)
        assert_tensors_close(plan.name, "param", ref.params, run.params)
        assert sorted(run.timelines) == list(range(len(plan.ranks) * dp))  # one process per (pipeline rank, replica)
        for rank, steps in run.timelines.items():
            pipeline_rank = rank // dp  # global rank p * dp + d (no rank map)
            done = [r.action for r in steps[0].records]
            assert done == [str(a) for a in rank_actions(plan)[pipeline_rank]]
            assert any("UNSHARD" in a for a in done) and any("REDUCE_GRAD" in a for a in done)


@pytest.mark.slow
@pytest.mark.extended  # 42 s; the MoE pp2 x dp2 x ep2 run below covers dp (and ep) by default
def test_llama_pp2_dp2_equals_the_reference() -> None:
    plans = mesh_plans("llama-8", ep=1)
    assert any(a.kind.name == "OVERLAP_F_B" for a in rank_actions(plans[3])[0])
    runs = run_local_many(plans, RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=180, pin_cores=False))
    assert_matches_reference(plans, runs)


@pytest.mark.slow
def test_moe_pp2_dp2_ep2_equals_the_reference() -> None:
    """Experts are split over the ep group (not FSDP-sharded); their gradients still equal the reference's."""
    plans = mesh_plans("moe-ep-4", ep=2)[:2]  # 1F1B and ZB-H1
    runs = run_local_many(plans, RunOptions(steps=3, keep_grads=True, keep_params=True, timeout_s=180, pin_cores=False))
    assert_matches_reference(plans, runs)
    assert any(".ffn.w1" in name for name in runs[0].grads)


@pytest.mark.slow
@pytest.mark.extended  # 4 ranks on 2 cores; pp2 x dp2 x ep2 above runs by default
def test_moe_pp1_dp4_ep2_sums_expert_gradients_over_the_ep_groups() -> None:
    """ep < dp: two ep groups hold the same experts; REDUCE_GRAD all-reduces their gradients (then / dp)."""
    m = 2
    reference = workload_reference("moe-ep-4", tiny=True, sequence=8, global_batch=4 * m)
    plan = gpipe(1, m, layer_names=[build_model(reference).model.pipeline_layers()])  # type: ignore[operator]
    plan.model.CopyFrom(reference)
    plan.mesh.dp, plan.mesh.ep = 4, 2
    plan = with_collectives(plan, AHEAD)
    (run,) = run_local_many(
        [plan], RunOptions(steps=2, keep_grads=True, keep_params=True, timeout_s=180, pin_cores=False)
    )
    ref = reference_run(plan.model, num_microbatches=4 * m, steps=2)
    assert run.losses == pytest.approx(ref.losses, rel=1e-6)
    for what, expected, actual in (("grad", ref.grads, run.grads), ("param", ref.params, run.params)):
        assert sorted(actual) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(actual[name], value, msg=lambda m, n=name, w=what: f"{w} {n}: {m}")  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.extended  # 17 s: a further placement of the same collectives
def test_a_rank_map_and_the_tuners_collective_placement() -> None:
    """mesh.global_ranks permutes processes (pipeline rank 0's replicas on processes 3 and 1, rank 1's on 0 and
    2); the collectives are placed by the tuner's ``place_collectives`` (all UNSHARDs up front, RESHARD before
    REDUCE_GRAD) on interleaved 1F1B, two stages per rank."""
    plan = mesh_plans("llama-8", ep=1)[2]
    policy = CollectivePlacement(prefetch=True, reshard=True)
    placed = place_collectives(rank_actions(plan), [s.rank for s in plan.stages], policy)
    for program in plan.ranks:
        del program.actions[:]
        program.actions.extend(action_to_proto(a) for a in placed[program.rank])
    plan.mesh.global_ranks[:] = [3, 1, 0, 2]
    (run,) = run_local_many([plan], RunOptions(steps=1, keep_grads=True, timeout_s=180, pin_cores=False))
    ref = reference_run(plan.model, num_microbatches=M * DP, steps=1)
    assert run.losses == pytest.approx(ref.losses, rel=1e-6)
    for name, value in ref.grads.items():
        torch.testing.assert_close(run.grads[name], value)
    done = {rank: [r.action for r in steps[0].records] for rank, steps in run.timelines.items()}
    assert done[3] == done[1] == [str(a) for a in placed[0]]
    assert done[0] == done[2] == [str(a) for a in placed[1]]
    assert done[3][:2] == ["0UNSHARD", "2UNSHARD"]


# ---- refusals, before any process starts ----


def test_plans_needing_different_world_sizes_are_refused() -> None:
    sharded, plain = mesh_plans("llama-8", ep=1)[0], mesh_plans("llama-8", ep=1)[0]
    plain.ClearField("mesh")
    with pytest.raises(ValueError, match=r"same number of processes.*\[4, 2\]"):
        run_local_many([sharded, plain])


def test_bad_meshes_are_refused() -> None:
    plan = mesh_plans("llama-8", ep=1)[0]
    plan.mesh.ep = 3
    with pytest.raises(PlanError, match="does not divide dp"):
        run_local_many([plan])
    plan.mesh.ep = 1
    plan.mesh.global_ranks[:] = [0, 1, 2, 2]
    with pytest.raises(PlanError, match="permutation"):
        run_local_many([plan])
    plan.mesh.global_ranks[:] = [0, 1, 2]
    with pytest.raises(PlanError, match="needs 4"):
        run_local_many([plan])
    plan.mesh.global_ranks[:] = []
    with pytest.raises(
        ValueError, match=r"needs 4 processes \(pp=2 x dp=2 x cp=1 x tp=1\), but the process group has 2"
    ):
        MeshRank.create(plan, 0, 2)  # a worker started with the wrong world size


def _without(plan: plan_pb2.Plan, rank: int, text: str) -> plan_pb2.Plan:
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    actions = out.ranks[rank].actions
    index = next(i for i, a in enumerate(rank_actions(out)[rank]) if str(a) == text)
    del actions[index]
    return out


def test_sharded_programs_without_unshard_or_reduce_grad_are_refused_before_any_rank_starts() -> None:
    plan = mesh_plans("llama-8", ep=1)[0]
    compile_plan(plan)
    with pytest.raises(
        MissingInputError, match=r"rank 1, step \d+ \(1F0\): stage 1's unsharded parameters .* put 1UNSHARD"
    ):
        run_local_many([_without(plan, 1, "1UNSHARD")])
    with pytest.raises(ActionCountError, match=r"rank 0, .*add 0REDUCE_GRAD to rank 0 after the stage's last backward"):
        run_local_many([_without(plan, 0, "0REDUCE_GRAD")])
    moved = plan_pb2.Plan()
    moved.CopyFrom(plan)
    first_f = next(i for i, a in enumerate(rank_actions(plan)[0]) if str(a) == "0F1")
    actions = list(plan.ranks[0].actions)
    reshard = next(i for i, a in enumerate(rank_actions(plan)[0]) if str(a) == "0RESHARD")
    del moved.ranks[0].actions[:]
    moved.ranks[0].actions.extend(
        [*actions[:first_f], actions[reshard], *actions[first_f:reshard], *actions[reshard + 1 :]]
    )
    with pytest.raises(MissingInputError, match=r"\(0F1\): stage 0's unsharded parameters"):
        run_local_many([moved])


def test_with_collectives_places_unshard_ahead_and_reduces_after_the_last_backward() -> None:
    plan = mesh_plans("llama-8", ep=1)[2]  # interleaved: stages 0 and 2 on rank 0
    program = rank_actions(plan)[0]
    texts = [str(a) for a in program]
    compute = [i for i, a in enumerate(program) if a.kind.is_compute]
    first_use = next(i for i in compute if program[i].stage == 2)
    previous = max(i for i in compute if i < first_use)
    # gathered one compute action early (prefetched): the next computation after it is the one before first use
    assert next(i for i in compute if i > texts.index("2UNSHARD")) == previous
    assert texts.index("0UNSHARD") < compute[0]
    for stage in (0, 2):
        last_backward = max(i for i in compute if program[i].stage == stage and program[i].kind.name != "FORWARD")
        after = [a for a in texts[last_backward + 1 :] if not ("SEND" in a or "RECV" in a)][:2]
        assert after == [f"{stage}RESHARD", f"{stage}REDUCE_GRAD"]
    assert with_collectives(plan, AHEAD) == plan  # idempotent
    exact = with_collectives(plan, CollectivePlacement(prefetch=False))
    texts = [str(a) for a in rank_actions(exact)[0]]
    following = [a for a in texts[texts.index("2UNSHARD") + 1 :] if not ("SEND" in a or "RECV" in a)]
    assert following[0].startswith("2F")
    assert "0RESHARD" not in texts
    compile_plan(exact)
    with pytest.raises(ValueError, match="ahead applies without prefetch"):
        CollectivePlacement(prefetch=True, ahead=1)


# ---- the interpreter's own refusals (one process, no group: a stand-in sharded stage) ----


class _FakeSharded:
    """Gathers nothing: UNSHARD hands out a plain stage; REDUCE_GRAD counts calls."""

    def __init__(self, exe: StageExecutable) -> None:
        self.exe = exe
        self.reduced = 0

    @property
    def graphs(self) -> StageGraphs:
        return self.exe.graphs

    @property
    def split(self) -> BWSplit:
        return self.exe.split

    @property
    def static_tensors(self) -> list[torch.Tensor]:
        return list(self.exe.params)

    def unshard(self) -> StageExecutable:
        return self.exe

    def reduce_grad(self, full_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        self.reduced += 1
        return list(full_grads)


Batches = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def one_stage() -> tuple[StageExecutable, Batches]:
    """The whole tiny llama as one captured stage, and two micro-batches."""
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2)
    built = build_model(reference)
    (stage,) = split_model(built.model, [built.model.pipeline_layers()])  # type: ignore[operator]
    tokens, targets = built.batch(0)
    return compile_stage(stage, [tokens[:1], targets[:1]]), list(zip(tokens.chunk(2), targets.chunk(2), strict=True))


def _runtime(program: str, exe: StageExecutable) -> tuple[RankRuntime, _FakeSharded]:
    fake = _FakeSharded(exe)
    plan = build_plan(stages=[StageSpec(rank=0)], actions={0: program.split()}, num_microbatches=2)
    compiled = compile_plan(plan)
    channels = Channels(
        program=compiled,
        rank=0,
        buffer_spec=lambda t: (torch.Size([1]), torch.float32),
        timeout_s=5,
        aborted=lambda: None,
    )
    return RankRuntime(rank=0, program=compiled, stages={0: fake}, channels=channels), fake


@pytest.mark.parametrize(
    ("program", "error", "says"),
    [
        ("0UNSHARD 0F0 0B0 0RESHARD 0F1 0B1 0REDUCE_GRAD", MissingInputError, r"\(0F1\): stage 0's unsharded"),
        ("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0F1 0B1", VerificationError, r"\(0F1\): stage 0's gradients were reduced"),
        ("0UNSHARD 0F0 0UNSHARD 0B0 0F1 0B1 0REDUCE_GRAD", VerificationError, r"\(0UNSHARD\): stage 0 is already"),
    ],
)
def test_a_sharded_stage_used_out_of_order_never_reaches_the_interpreter(
    program: str, error: type[VerificationError], says: str
) -> None:
    """The interpreter runs only compiled programs; the compiler refuses these, naming the step."""
    with pytest.raises(error, match=says):
        compile_plan(build_plan(stages=[StageSpec(rank=0)], actions={0: program.split()}, num_microbatches=2))


def test_the_interpreter_gathers_every_step_and_reduces_once(one_stage: tuple[StageExecutable, Batches]) -> None:
    exe, microbatches = one_stage
    runtime, fake = _runtime("0UNSHARD 0F0 0B0 0F1 0B1 0REDUCE_GRAD 0RESHARD", exe)
    for step in range(2):
        assert runtime.run_step(step, microbatches) is not None
        assert fake.reduced == step + 1
        assert all(g is not None for g in runtime.grads[0])
        assert 0 not in runtime.stages  # resharded
        runtime.zero_grads()


def test_replica_batch_is_the_replicas_slice_and_checks_divisibility() -> None:
    tokens, targets = torch.arange(8).view(8, 1), torch.arange(8).view(8, 1) + 100
    mine = replica_batch(tokens, targets, dp=2, replica=1, num_microbatches=2)
    assert mine[0].view(-1).tolist() == [4, 5, 6, 7] and mine[1].view(-1).tolist() == [104, 105, 106, 107]
    with pytest.raises(ValueError, match="make it a multiple of 6"):
        replica_batch(tokens, targets, dp=2, replica=0, num_microbatches=3)
