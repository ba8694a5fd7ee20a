"""Joining a torchrun launch as one rank (``octopipe run PLAN --torchrun``, ``octopipe train CONFIG
--torchrun``): the environment torchrun sets, checked; the plan verified; the rank's orders run."""

from __future__ import annotations

import os
from pathlib import Path

from octopipe.execute.runs import RunOptions, WorkerConfig, optimization_problem, precision_problem, weights_problem
from octopipe.ir import mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import verify_plan

__all__ = ["torchrun_rank"]


def torchrun_rank(plan: plan_pb2.Plan, options: RunOptions, out: Path) -> tuple[int, int]:
    """Run this process's rank of ``plan`` in the torchrun launch around it; its results go to
    ``out/rank<r>.pt``. Returns (rank, world size). A launch of the wrong size, a plan the verifier
    rejects or options the plan cannot run are refused in one line before anything starts."""
    from octopipe.execute.runtime import worker_main  # noqa: PLC0415 - torch loads only here
    from octopipe.execute.runtime.tensor_parallel import split_problem  # noqa: PLC0415

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"--torchrun needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment ({exc})"
        ) from None
    needed = mesh_spec(plan).world_size  # pipeline ranks x data-parallel replicas
    if world != needed:
        raise ValueError(
            f"the launch has {world} ranks but the plan needs {needed} "
            f"({len(plan.ranks)} pipeline ranks x {needed // len(plan.ranks)} replicas, context and tensor ranks): "
            "start torchrun with "
            f"--nproc-per-node {needed} (or as many ranks over its nodes)"
        )
    verify_plan(plan)  # every launch path verifies first: a plan the verifier rejects never runs
    problem = precision_problem(plan) or optimization_problem(plan, options.optimization)
    if problem := problem or weights_problem(plan, options.weights) or split_problem(plan):
        raise ValueError(problem)
    out.mkdir(parents=True, exist_ok=True)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # torchrun's: this rank's index on its machine (its GPU)
    worker_main(
        WorkerConfig.for_rank(
            options,
            plans=[plan.SerializeToString()],
            rank=rank,
            world_size=world,
            store_host=host,
            store_port=port,
            store_is_master=rank == 0 and not agent_store,
            result_dir=str(out),
            local_rank=local_rank,
        )
    )
    return rank, world
