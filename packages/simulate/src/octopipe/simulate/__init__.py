"""octopipe.simulate: the Plan IR, the DAG simulator and the static plan verifier.

Never imports torch: it reads and writes protos and plain Python data.
``simulate(plan, profile)`` times one step of a plan and returns a
:class:`Simulation` (its :class:`Estimate`, timeline and memory);
``verify_plan(plan)`` rejects a plan that cannot run, naming the rank, step
and action.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.ir import (
    Action,
    ActionKind,
    MeshSpec,
    PlanError,
    StageSpec,
    build_plan,
    format_action,
    format_grid,
    load_plan,
    mesh_spec,
    parse_action,
    plan_from_text,
    plan_from_torch_csv,
    plan_to_text,
    plan_to_torch_csv,
    rank_actions,
    save_plan,
    validate_plan,
)
from octopipe.ir.errors import (
    ActionCountError,
    DeadlockError,
    MemoryCapError,
    MissingInputError,
    VerificationError,
)
from octopipe.simulate.calibrate import (
    Calibration,
    calibrate_profile,
    fit_link_latency,
    fit_message_costs,
    fit_term,
    probe_bounds,
    with_link_latency,
    with_receive_cpu,
)
from octopipe.simulate.collectives import (
    GroupLinks,
    all_gather_us,
    all_reduce_us,
    all_to_all_us,
    bucketed_us,
    reduce_scatter_us,
)
from octopipe.simulate.costs import (
    RECOMPUTED_FIELDS,
    CostModel,
    Link,
    OverlapModel,
    StageCost,
    TiedExchange,
    durations_from_timelines,
    recomputed_cost,
    stage_cost_from_layers,
    stage_scratch,
    tied_exchanges,
)
from octopipe.simulate.estimate import Estimate, PathStep, RankEstimate
from octopipe.simulate.exposure import exposed_collective_us
from octopipe.simulate.local import LOCAL_GLOO_LINK, local_cost_model, local_link
from octopipe.simulate.profiles import uniform_profile
from octopipe.simulate.runtime_costs import BOUNDS, DISPATCHED_KINDS, FittedTerm, MessageCpu, RuntimeCosts
from octopipe.simulate.simulator import ActionTiming, Simulation, SimulationConfig, simulate, verify_plan
from octopipe.simulate.tensor_parallel import ParallelTraffic, layer_traffic, split_layer, traffic_us
from octopipe.simulate.trace import plot_timeline, to_chrome_trace, write_chrome_trace

try:
    __version__ = version("octopipe-simulate")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "BOUNDS",
    "DISPATCHED_KINDS",
    "LOCAL_GLOO_LINK",
    "RECOMPUTED_FIELDS",
    "Action",
    "ActionCountError",
    "ActionKind",
    "ActionTiming",
    "Calibration",
    "CostModel",
    "DeadlockError",
    "Estimate",
    "FittedTerm",
    "GroupLinks",
    "Link",
    "MemoryCapError",
    "MeshSpec",
    "MessageCpu",
    "MissingInputError",
    "OverlapModel",
    "ParallelTraffic",
    "PathStep",
    "PlanError",
    "RankEstimate",
    "RuntimeCosts",
    "Simulation",
    "SimulationConfig",
    "StageCost",
    "StageSpec",
    "TiedExchange",
    "VerificationError",
    "__version__",
    "all_gather_us",
    "all_reduce_us",
    "all_to_all_us",
    "bucketed_us",
    "build_plan",
    "calibrate_profile",
    "durations_from_timelines",
    "exposed_collective_us",
    "fit_link_latency",
    "fit_message_costs",
    "fit_term",
    "format_action",
    "format_grid",
    "layer_traffic",
    "load_plan",
    "local_cost_model",
    "local_link",
    "mesh_spec",
    "parse_action",
    "plan_from_text",
    "plan_from_torch_csv",
    "plan_to_text",
    "plan_to_torch_csv",
    "plot_timeline",
    "probe_bounds",
    "rank_actions",
    "recomputed_cost",
    "reduce_scatter_us",
    "save_plan",
    "simulate",
    "split_layer",
    "stage_cost_from_layers",
    "stage_scratch",
    "tied_exchanges",
    "to_chrome_trace",
    "traffic_us",
    "uniform_profile",
    "validate_plan",
    "verify_plan",
    "with_link_latency",
    "with_receive_cpu",
    "write_chrome_trace",
]
