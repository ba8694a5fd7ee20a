"""octopipe.transform: pure graph passes over captured stages, and the layer profiler.

The automatic B/W split of a stage's backward (``split_backward``) and the
runnable split stage (``StageExecutable``); the stage compiler every runtime
and the profiler compile through (``StageCompiler``: capture, FSDP split,
B/W split, multiplexing); the FSDP collective split into
UNSHARD and REDUCE_GRAD graphs (``shard_parameters``, ``split_fsdp``,
``FSDPStage``); forward/backward multiplexing that overlaps communication
with the other half's compute (``multiplex``, ``OverlapStage`` for
OVERLAP_F_B, cost models); and the profiler.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.transform.allocator import AllocatorPeak, CudaAllocatorPeak
from octopipe.transform.bw_split import BWSplit, split_backward
from octopipe.transform.compile_cache import (
    CompileIndex,
    GraphTiming,
    default_compile_root,
    graph_key,
    use_compile_cache_dirs,
)
from octopipe.transform.compiler import BackwardKind, CompiledStage, StageCompiler, compile_fsdp_stage, compile_stage
from octopipe.transform.costs import (
    CostModel,
    Roofline,
    comm_bytes,
    graph_flops,
    measure_compute_us,
    profile_costs,
    roofline_costs,
    table_costs,
)
from octopipe.transform.device import CPU, Device, DeviceError, GpuInfo, Stopwatch, visible_gpus
from octopipe.transform.executable import ForwardContext, StageExecutable, WeightContext
from octopipe.transform.fsdp import ShardConfig, ShardSpec, shard_parameters, shard_specs, unshard_tensor
from octopipe.transform.fsdp_bucket import BucketPolicy, bucket_collectives, count_collectives
from octopipe.transform.fsdp_split import NOT_HANDLED, FSDPGraphs, FSDPStage, ParamChain, split_fsdp
from octopipe.transform.host_memory import (
    HOST_MEMORY_POLICIES,
    HostMemory,
    HostMemoryState,
    configure_host_memory,
    host_memory_policy,
)
from octopipe.transform.inductor import (
    BACKENDS,
    COMPILED_TOLERANCE,
    Backend,
    CompileError,
    compile_stage_graphs,
    compiled_tolerance,
    stage_backend,
)
from octopipe.transform.multiplexing import CommOverlap, Multiplexed, OverlapReport, Simulation, multiplex, simulate
from octopipe.transform.overlap import OverlapResult, OverlapStage
from octopipe.transform.profiler import (
    ProfilerConfig,
    format_profile,
    profile_layers,
    profile_stages,
    storage_bytes,
    storage_pointers,
)
from octopipe.transform.tensor_parallel import (
    TPSpec,
    all_reduce_tp,
    copy_to_tp,
    gather_sequence,
    gather_tp,
    reduce_from_tp,
    scatter_sequence,
    shard_tp,
    slice_parameter,
)

try:
    __version__ = version("octopipe-transform")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "BACKENDS",
    "COMPILED_TOLERANCE",
    "CPU",
    "HOST_MEMORY_POLICIES",
    "NOT_HANDLED",
    "AllocatorPeak",
    "BWSplit",
    "Backend",
    "BackwardKind",
    "BucketPolicy",
    "CommOverlap",
    "CompileError",
    "CompileIndex",
    "CompiledStage",
    "CostModel",
    "CudaAllocatorPeak",
    "Device",
    "DeviceError",
    "FSDPGraphs",
    "FSDPStage",
    "ForwardContext",
    "GpuInfo",
    "GraphTiming",
    "HostMemory",
    "HostMemoryState",
    "Multiplexed",
    "OverlapReport",
    "OverlapResult",
    "OverlapStage",
    "ParamChain",
    "ProfilerConfig",
    "Roofline",
    "ShardConfig",
    "ShardSpec",
    "Simulation",
    "StageCompiler",
    "StageExecutable",
    "Stopwatch",
    "TPSpec",
    "WeightContext",
    "__version__",
    "all_reduce_tp",
    "bucket_collectives",
    "comm_bytes",
    "compile_fsdp_stage",
    "compile_stage",
    "compile_stage_graphs",
    "compiled_tolerance",
    "configure_host_memory",
    "copy_to_tp",
    "count_collectives",
    "default_compile_root",
    "format_profile",
    "gather_sequence",
    "gather_tp",
    "graph_flops",
    "graph_key",
    "host_memory_policy",
    "measure_compute_us",
    "multiplex",
    "profile_costs",
    "profile_layers",
    "profile_stages",
    "reduce_from_tp",
    "roofline_costs",
    "scatter_sequence",
    "shard_parameters",
    "shard_specs",
    "shard_tp",
    "simulate",
    "slice_parameter",
    "split_backward",
    "split_fsdp",
    "stage_backend",
    "storage_bytes",
    "storage_pointers",
    "table_costs",
    "unshard_tensor",
    "use_compile_cache_dirs",
    "visible_gpus",
]
