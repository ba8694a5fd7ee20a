"""octopipe.simulate: the Plan IR, and (to come) the DAG simulator and static verifier.

Never imports torch: it reads and writes protos and plain Python data.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.simulate.ir import (
    Action,
    ActionKind,
    PlanError,
    StageSpec,
    build_plan,
    format_action,
    format_grid,
    load_plan,
    parse_action,
    plan_from_text,
    plan_from_torch_csv,
    plan_to_text,
    plan_to_torch_csv,
    rank_actions,
    save_plan,
    validate_plan,
)

try:
    __version__ = version("octopipe-simulate")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Action",
    "ActionKind",
    "PlanError",
    "StageSpec",
    "__version__",
    "build_plan",
    "format_action",
    "format_grid",
    "load_plan",
    "parse_action",
    "plan_from_text",
    "plan_from_torch_csv",
    "plan_to_text",
    "plan_to_torch_csv",
    "rank_actions",
    "save_plan",
    "validate_plan",
]
