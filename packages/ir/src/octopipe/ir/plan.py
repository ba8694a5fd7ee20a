"""Building, checking and reading Plans (``octopipe.plan.v1.Plan``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from octopipe.ir.actions import Action, action_from_proto, action_to_proto, parse_action
from octopipe.ir.mesh import mesh_spec
from octopipe.ir.plan_error import PlanError
from octopipe.ir.recompute import check_recompute
from octopipe.plan.v1 import plan_pb2

__all__ = [
    "COMPUTE_DTYPES",
    "PlanError",
    "StageSpec",
    "build_plan",
    "compute_dtype",
    "rank_actions",
    "stage_ranks",
    "validate_plan",
]


#: what a plan's ``precision.compute_dtype`` may name ("" reads as float32)
COMPUTE_DTYPES: Final = ("float32", "bfloat16")


def compute_dtype(plan: plan_pb2.Plan) -> str:
    """The dtype the plan's parameters and activations are held and computed in: ``float32`` (also for no
    ``precision``) or ``bfloat16``; PlanError for anything else."""
    name = plan.precision.compute_dtype or "float32"
    if name not in COMPUTE_DTYPES:
        raise PlanError(f"precision.compute_dtype {name!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return name


@dataclass(kw_only=True, frozen=True)
class StageSpec:
    """One stage of a plan being built: its layers and the rank that runs it."""

    rank: int
    layer_names: tuple[str, ...] = field(default_factory=tuple)


def build_plan(
    *,
    stages: Sequence[StageSpec],
    actions: Mapping[int, Sequence[Action | str]],
    num_microbatches: int,
    name: str = "",
    version: int = 0,
    model: plan_pb2.ModelReference | None = None,
    memory_caps: Mapping[int, int] | None = None,
    labels: Mapping[str, str] | None = None,
) -> plan_pb2.Plan:
    """Assemble and validate a Plan.

    ``actions`` maps each rank to its ordered actions (Action objects or their
    text); ranks run from 0 to the highest rank any stage is placed on.
    """
    plan = plan_pb2.Plan(name=name, version=version, num_microbatches=num_microbatches)
    if model is not None:
        plan.model.CopyFrom(model)
    for index, spec in enumerate(stages):
        plan.stages.add(stage_index=index, rank=spec.rank, layer_names=list(spec.layer_names))
    num_ranks = max([s.rank + 1 for s in stages] + [r + 1 for r in actions], default=0)
    caps = dict(memory_caps or {})
    unknown = sorted(set(caps) - set(range(num_ranks)))
    if unknown:
        raise PlanError(f"memory caps given for ranks {unknown}, but the plan has ranks 0..{num_ranks - 1}")
    for rank in range(num_ranks):
        program = plan.ranks.add(rank=rank)
        if rank in caps:
            program.memory_cap_bytes = caps[rank]
        for item in actions.get(rank, ()):
            action = parse_action(item) if isinstance(item, str) else item
            program.actions.append(action_to_proto(action))
    for key, value in (labels or {}).items():
        plan.labels[key] = value
    validate_plan(plan)
    return plan


def rank_actions(plan: plan_pb2.Plan) -> dict[int, list[Action]]:
    """Each rank's ordered actions as Action objects."""
    return {program.rank: [action_from_proto(a) for a in program.actions] for program in plan.ranks}


def stage_ranks(plan: plan_pb2.Plan) -> dict[int, int]:
    """The placement: stage index -> rank."""
    return {stage.stage_index: stage.rank for stage in plan.stages}


def validate_plan(plan: plan_pb2.Plan) -> None:
    """Check a Plan's structure; raise PlanError naming what is wrong and where.

    This checks form, not timing: indices in range, stages placed where their
    actions run, layers named once, and the mesh (``mesh_spec``: ep divides
    dp, the global rank map is a permutation of 0..pp*dp-1, so every
    (pipeline rank, replica) has exactly one process and every stage replica
    is complete). Deadlocks, data dependencies, the order of collectives and
    memory are the simulator's verifier's job.
    """
    if plan.num_microbatches < 1:
        raise PlanError(f"num_microbatches is {plan.num_microbatches}: a plan needs at least 1 micro-batch")
    if not plan.stages:
        raise PlanError("the plan has no stages: add at least one stage with its layers and rank")
    num_ranks = len(plan.ranks)
    for position, program in enumerate(plan.ranks):
        if program.rank != position:
            raise PlanError(
                f"ranks[{position}] says rank {program.rank}: list rank programs in order 0..{num_ranks - 1}"
            )
    seen_layers: dict[str, int] = {}
    for position, stage in enumerate(plan.stages):
        if stage.stage_index != position:
            raise PlanError(
                f"stages[{position}] says stage {stage.stage_index}: list stages in order 0..{len(plan.stages) - 1}"
            )
        if stage.rank >= num_ranks:
            raise PlanError(
                f"stage {position} is placed on rank {stage.rank}, but the plan has {num_ranks} rank programs"
            )
        for layer in stage.layer_names:
            if layer in seen_layers:
                raise PlanError(
                    f"layer {layer!r} is in stage {seen_layers[layer]} and stage {position}: a layer belongs to one stage"
                )
            seen_layers[layer] = position
        check_recompute(stage)
    mesh_spec(plan)
    compute_dtype(plan)
    placement = stage_ranks(plan)
    m = plan.num_microbatches
    for program in plan.ranks:
        rank = program.rank
        for step, message in enumerate(program.actions):
            # fast path for the common, valid plain action; anything else gets the full check and its message
            kind = message.kind
            if kind in _PLAIN and not message.sub_actions and placement.get(message.stage_index) == rank:
                if kind in _STAGE_WIDE:
                    if not message.HasField("microbatch_index"):
                        continue
                elif message.HasField("microbatch_index") and message.microbatch_index < m:
                    continue
            _check_action(plan, placement, rank, step, message)


_STAGE_WIDE: Final = frozenset(
    {plan_pb2.ACTION_KIND_UNSHARD, plan_pb2.ACTION_KIND_RESHARD, plan_pb2.ACTION_KIND_REDUCE_GRAD}
)
_PLAIN: Final = frozenset(
    set(plan_pb2.ActionKind.values()) - {plan_pb2.ACTION_KIND_UNSPECIFIED, plan_pb2.ACTION_KIND_OVERLAP_F_B}
)


def _check_action(
    plan: plan_pb2.Plan, placement: dict[int, int], rank: int, step: int, message: plan_pb2.Action
) -> None:
    where = f"rank {rank}, step {step}"
    try:
        action = action_from_proto(message)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    for part in action.computations:
        if part.stage not in placement:
            raise PlanError(
                f"{where} ({action}): stage {part.stage} does not exist; the plan has stages 0..{len(plan.stages) - 1}"
            )
        if placement[part.stage] != rank:
            raise PlanError(
                f"{where} ({action}): stage {part.stage} is placed on rank {placement[part.stage]}, "
                f"so its actions belong in rank {placement[part.stage]}'s program"
            )
        if part.microbatch is not None and part.microbatch >= plan.num_microbatches:
            raise PlanError(
                f"{where} ({action}): micro-batch {part.microbatch} is out of range; "
                f"the plan has {plan.num_microbatches} micro-batches (0..{plan.num_microbatches - 1})"
            )
