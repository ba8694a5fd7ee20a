"""The runtime: interpret a Plan's per-rank actions on torch.distributed."""

from octopipe.execute.runs import ActionRecord, RunFailed, RunOptions, RunResult, StepTimeline
from octopipe.execute.runtime.comm import Aborted, Channels, CommTimeout
from octopipe.execute.runtime.emulate import EMULATED_RANK_BYTES, EmulatedStage, emulation_problem
from octopipe.execute.runtime.interpreter import RankRuntime, StepFailure
from octopipe.execute.runtime.launcher import run_local, run_local_many
from octopipe.execute.runtime.measure import (
    measured_step_times_us,
    median_step_time_us,
    side_by_side_trace,
    timelines_to_proto,
    write_side_by_side_trace,
)
from octopipe.execute.runtime.models import BuiltModel, build_model, workload_reference
from octopipe.execute.runtime.reference import ReferenceResult, reference_run
from octopipe.execute.runtime.worker import worker_main

__all__ = [
    "EMULATED_RANK_BYTES",
    "Aborted",
    "ActionRecord",
    "BuiltModel",
    "Channels",
    "CommTimeout",
    "EmulatedStage",
    "RankRuntime",
    "ReferenceResult",
    "RunFailed",
    "RunOptions",
    "RunResult",
    "StepFailure",
    "StepTimeline",
    "build_model",
    "emulation_problem",
    "measured_step_times_us",
    "median_step_time_us",
    "reference_run",
    "run_local",
    "run_local_many",
    "side_by_side_trace",
    "timelines_to_proto",
    "worker_main",
    "workload_reference",
    "write_side_by_side_trace",
]
