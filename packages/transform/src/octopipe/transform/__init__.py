"""octopipe.transform: pure graph passes over captured stages, and the layer profiler.

Today: the automatic B/W split of a stage's backward (``split_backward``), the
runnable split stage (``StageExecutable``) and the profiler.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.transform.bw_split import BWSplit, split_backward
from octopipe.transform.executable import ForwardContext, StageExecutable, WeightContext, compile_stage
from octopipe.transform.profiler import ProfilerConfig, format_profile, profile_layers, storage_bytes

try:
    __version__ = version("octopipe-transform")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "BWSplit",
    "ForwardContext",
    "ProfilerConfig",
    "StageExecutable",
    "WeightContext",
    "__version__",
    "compile_stage",
    "format_profile",
    "profile_layers",
    "split_backward",
    "storage_bytes",
]
