"""Checking a plan that arrives over the network before anything runs it.

Bounds come first (so a hostile plan cannot make verification itself slow),
then the IR's structural check, the mesh, the model reference, and the
simulator's static verifier (deadlocks, missing inputs, unmatched sends).
"""

from __future__ import annotations

import math
import re

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.runs import STAGE_BACKENDS
from octopipe.ir import PlanError, mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import VerificationError, verify_plan

__all__ = [
    "MAX_ACTIONS",
    "MAX_MICROBATCHES",
    "MAX_RANKS",
    "adapt_problem",
    "check_plan",
    "options_problem",
    "profile_problem",
    "run_id_problem",
]

#: a run id names folders (the coordinator's state, a daemon's work folder): never a path
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def run_id_problem(run_id: str) -> str:
    """Why ``run_id`` cannot name a run ('' when it can): 1-63 letters, digits, '.', '_' or '-', starting with
    a letter or a digit, so it is never a path outside the folders it names."""
    if _RUN_ID.fullmatch(run_id):
        return ""
    shown = run_id if len(run_id) <= 80 else run_id[:77] + "..."
    return (
        f"run id {shown!r} is not allowed: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or a "
        "digit (or none: the coordinator picks one)"
    )


MAX_RANKS = 16_384
MAX_MICROBATCHES = 65_536
MAX_ACTIONS = 2_000_000
MAX_STEPS = 10_000_000


def _layers(plan: plan_pb2.Plan) -> list[str]:
    return sorted(layer for stage in plan.stages for layer in stage.layer_names)


def check_plan(plan: plan_pb2.Plan, *, num_steps: int = 0, like: plan_pb2.Plan | None = None) -> str:
    """What is wrong with ``plan`` for a run (empty when nothing is); ``like``: a plan it must share layers with."""
    if len(plan.ranks) > MAX_RANKS:
        return f"the plan has {len(plan.ranks)} ranks; at most {MAX_RANKS} are accepted"
    if plan.num_microbatches > MAX_MICROBATCHES:
        return f"the plan has {plan.num_microbatches} micro-batches; at most {MAX_MICROBATCHES} are accepted"
    actions = sum(len(program.actions) for program in plan.ranks)
    if actions > MAX_ACTIONS:
        return f"the plan has {actions} actions; at most {MAX_ACTIONS} are accepted"
    if num_steps > MAX_STEPS:
        return f"num_steps {num_steps} is more than {MAX_STEPS}"
    if not plan.model.source or not plan.model.name:
        return "the plan names no model: set model.name and model.source (e.g. octopipe.examples:workload)"
    try:
        mesh_spec(plan)
        verify_plan(plan)
    except (PlanError, VerificationError) as exc:
        return f"the plan does not verify: {exc}"
    except RecursionError:
        return "the plan nests actions too deeply"
    if like is not None and _layers(plan) != _layers(like):
        return "the new plan must hold the same layers as the run's plan (a resume keeps the model)"
    return ""


def profile_problem(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> str:
    """Why ``profile`` cannot cost ``plan`` (empty when it can): a layer of the plan it has no cost for."""
    profiled = {layer.layer_name for layer in profile.layers}
    missing = sorted({name for stage in plan.stages for name in stage.layer_names} - profiled)
    if missing:
        return f"the profile has no costs for layers {missing[:5]}: profile the plan's model"
    return ""


def adapt_problem(request: coordinator_pb2.SubmitPlanRequest) -> str:
    """What keeps a submission from running with the closed loop (empty when nothing)."""
    if not request.HasField("profile") or not request.profile.layers:
        return "adapt needs the plan's profile (from `octopipe profile`) in the submission"
    if problem := profile_problem(request.plan, request.profile):
        return problem
    if request.num_steps and request.num_steps <= (request.adapt_after_steps or 3) + 1:
        return "adapt needs more steps than adapt_after_steps + 1 to measure before switching"
    return ""


def options_problem(request: coordinator_pb2.SubmitPlanRequest) -> str:
    """What is wrong with a submission's checkpoint, recovery and deadline options (empty when nothing)."""
    if (request.checkpoint_async or request.checkpoint_keep) and not request.checkpoint_every:
        return "checkpoint_async and checkpoint_keep need checkpoint_every > 0 (steps between checkpoints)"
    if request.compile and request.compile not in STAGE_BACKENDS:
        return f"compile must be one of {', '.join(STAGE_BACKENDS)} (or empty: eager), got {request.compile!r}"
    policy = request.recovery
    for name, value in (
        ("queue_deadline_s", request.queue_deadline_s),
        ("recovery.wait_for_replacement_s", policy.wait_for_replacement_s),
    ):
        if not math.isfinite(value) or value < 0:
            return f"{name} must be a finite number of seconds >= 0, got {value}"
    if (policy.wait_for_replacement_s or policy.max_recoveries or policy.memory_cap_bytes) and not policy.automatic:
        return "the recovery policy sets limits but not automatic: set recovery.automatic (--recover) to use them"
    return ""
