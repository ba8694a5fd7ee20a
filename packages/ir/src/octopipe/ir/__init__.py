"""octopipe.ir: the Plan IR (typed actions over ``octopipe.plan.v1``, text, torch CSV, files), its lowering passes and the per-rank program.

Never imports torch.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.ir.actions import (
    Action,
    ActionKind,
    action_from_proto,
    action_to_proto,
    format_action,
    parse_action,
)
from octopipe.ir.errors import (
    ActionCountError,
    DeadlockError,
    MemoryCapError,
    MissingInputError,
    VerificationError,
)
from octopipe.ir.files import PlanFormat, load_plan, plan_format_for, save_plan
from octopipe.ir.fsdp import PLACEMENTS, CollectivePlacement, place_collectives, with_collectives
from octopipe.ir.grid import format_grid
from octopipe.ir.lower import add_p2p_actions
from octopipe.ir.merge import merge_backward
from octopipe.ir.mesh import MeshCoord, MeshSpec, check_mesh_model, mesh_spec
from octopipe.ir.plan import (
    COMPUTE_DTYPES,
    PlanError,
    StageSpec,
    build_plan,
    compute_dtype,
    rank_actions,
    stage_ranks,
    validate_plan,
)
from octopipe.ir.program import Program, compile_plan
from octopipe.ir.recompute import RECOMPUTE_NAMES, Recompute, check_recompute, recompute_of, with_recompute
from octopipe.ir.text import plan_from_text, plan_to_text
from octopipe.ir.torch_csv import CsvFormat, plan_from_torch_csv, plan_to_torch_csv

try:
    __version__ = version("octopipe-ir")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "COMPUTE_DTYPES",
    "PLACEMENTS",
    "RECOMPUTE_NAMES",
    "Action",
    "ActionCountError",
    "ActionKind",
    "CollectivePlacement",
    "CsvFormat",
    "DeadlockError",
    "MemoryCapError",
    "MeshCoord",
    "MeshSpec",
    "MissingInputError",
    "PlanError",
    "PlanFormat",
    "Program",
    "Recompute",
    "StageSpec",
    "VerificationError",
    "__version__",
    "action_from_proto",
    "action_to_proto",
    "add_p2p_actions",
    "build_plan",
    "check_mesh_model",
    "check_recompute",
    "compile_plan",
    "compute_dtype",
    "format_action",
    "format_grid",
    "load_plan",
    "merge_backward",
    "mesh_spec",
    "parse_action",
    "place_collectives",
    "plan_format_for",
    "plan_from_text",
    "plan_from_torch_csv",
    "plan_to_text",
    "plan_to_torch_csv",
    "rank_actions",
    "recompute_of",
    "save_plan",
    "stage_ranks",
    "validate_plan",
    "with_collectives",
    "with_recompute",
]
