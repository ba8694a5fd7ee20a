"""octopipe.examples: the model zoo and the standard benchmark workloads."""

from importlib.metadata import PackageNotFoundError, version

from octopipe.examples.models import DecoderLM, ModelConfig, jamba, llama, moe_decoder, nemotron_h
from octopipe.examples.workloads import WORKLOADS, Workload, workload

try:
    __version__ = version("octopipe-examples")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "WORKLOADS",
    "DecoderLM",
    "ModelConfig",
    "Workload",
    "__version__",
    "jamba",
    "llama",
    "moe_decoder",
    "nemotron_h",
    "workload",
]
