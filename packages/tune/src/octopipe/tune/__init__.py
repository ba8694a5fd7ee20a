"""octopipe.tune: the schedule library and the partition x placement x schedule co-optimizer.

Never imports torch. Schedules are functions that return a Plan, registered
in one typed, immutable table (``DEFAULT_SCHEDULES``, a ``ScheduleRegistry``
of ``ScheduleEntry``: name, ``Placement``, generator, split backward, torch
class); ``tune`` searches partitions, placements and the registry's
schedules, scoring each candidate with the simulator, under per-rank memory
caps; ``tune_mesh`` chooses pp x dp (and the micro-batch count) for a number
of devices and places the FSDP collectives; ``retune`` re-schedules a running
plan from its measured timelines (the closed loop); ``exact_schedule`` (extra
``octopipe-tune[exact]``) solves small instances optimally for comparison.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.ir.fsdp import PLACEMENTS, CollectivePlacement, place_collectives
from octopipe.tune.exact import ExactResult, exact_schedule
from octopipe.tune.listsched import ListSchedulerConfig, list_schedule
from octopipe.tune.mesh_search import MeshCandidate, MeshTuneConfig, MeshTuneResult, scale_microbatches, tune_mesh
from octopipe.tune.optimizer import PhaseReport, TuneConfig, TuneResult, tune
from octopipe.tune.partition import equal_partition
from octopipe.tune.problem import FAMILIES, balanced_bounds, equal_bounds, placement_for, recompute_options
from octopipe.tune.registry import DEFAULT_SCHEDULES, Placement, ScheduleEntry, ScheduleGenerator, ScheduleRegistry
from octopipe.tune.retune import Retune, calibrated_costs, measured_gain, replan, retune
from octopipe.tune.schedules import (
    check_schedule_args,
    compute_plan,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_h2,
)
from octopipe.tune.vshape import dualpipe_v, v_half, v_min, v_placement, zb_v

try:
    __version__ = version("octopipe-tune")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "DEFAULT_SCHEDULES",
    "FAMILIES",
    "PLACEMENTS",
    "CollectivePlacement",
    "ExactResult",
    "ListSchedulerConfig",
    "MeshCandidate",
    "MeshTuneConfig",
    "MeshTuneResult",
    "PhaseReport",
    "Placement",
    "Retune",
    "ScheduleEntry",
    "ScheduleGenerator",
    "ScheduleRegistry",
    "TuneConfig",
    "TuneResult",
    "__version__",
    "balanced_bounds",
    "calibrated_costs",
    "check_schedule_args",
    "compute_plan",
    "dualpipe_v",
    "equal_bounds",
    "equal_partition",
    "exact_schedule",
    "gpipe",
    "interleaved_1f1b",
    "list_schedule",
    "measured_gain",
    "one_f_one_b",
    "place_collectives",
    "placement_for",
    "recompute_options",
    "replan",
    "retune",
    "scale_microbatches",
    "tune",
    "tune_mesh",
    "v_half",
    "v_min",
    "v_placement",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
