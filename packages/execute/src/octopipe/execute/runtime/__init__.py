"""The runtime: interpret a Plan's per-rank actions on torch.distributed."""

from octopipe.execute.runtime.comm import P2P, Aborted, CommTimeout
from octopipe.execute.runtime.interpreter import ActionRecord, RankRuntime, StepFailure
from octopipe.execute.runtime.launcher import RunFailed, RunResult, run_local, run_local_many
from octopipe.execute.runtime.models import BuiltModel, build_model, workload_reference
from octopipe.execute.runtime.reference import ReferenceResult, reference_run
from octopipe.execute.runtime.worker import WorkerConfig, worker_main

__all__ = [
    "P2P",
    "Aborted",
    "ActionRecord",
    "BuiltModel",
    "CommTimeout",
    "RankRuntime",
    "ReferenceResult",
    "RunFailed",
    "RunResult",
    "StepFailure",
    "WorkerConfig",
    "build_model",
    "reference_run",
    "run_local",
    "run_local_many",
    "worker_main",
    "workload_reference",
]
