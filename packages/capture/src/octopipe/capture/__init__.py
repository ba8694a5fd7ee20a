"""octopipe.capture: split a model into pipeline stages and trace each stage's joint forward+backward.

No user writes a backward function: each stage's forward and backward are
captured as FX graphs of ATen ops (AOTAutograd), parameters and buffers lifted
as inputs. octopipe.transform splits the backward into B and W graphs.
"""

from importlib.metadata import PackageNotFoundError, version

from octopipe.capture.graph_split import GraphStage, TiedParameter, split_graph, tied_parameters
from octopipe.capture.graphs import StageGraphs
from octopipe.capture.hf import hf_causal_lm_spec, is_hf_causal_lm
from octopipe.capture.model_graph import ModelGraph, discover_layers, trace_model
from octopipe.capture.numerics import (
    NumericsError,
    NumericsReport,
    StageForward,
    captured_forwards,
    check_numerics,
    compare_outputs,
)
from octopipe.capture.spec import pipeline_spec
from octopipe.capture.stage import StageModule, split_model
from octopipe.capture.trace import CaptureConfig, capture_stage, live_nodes, prune_dead_nodes
from octopipe.capture.types import CaptureError, LayerSpec, LossFn, PipelineSpec

try:
    __version__ = version("octopipe-capture")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "CaptureConfig",
    "CaptureError",
    "GraphStage",
    "LayerSpec",
    "LossFn",
    "ModelGraph",
    "NumericsError",
    "NumericsReport",
    "PipelineSpec",
    "StageForward",
    "StageGraphs",
    "StageModule",
    "TiedParameter",
    "__version__",
    "capture_stage",
    "captured_forwards",
    "check_numerics",
    "compare_outputs",
    "discover_layers",
    "hf_causal_lm_spec",
    "is_hf_causal_lm",
    "live_nodes",
    "pipeline_spec",
    "prune_dead_nodes",
    "split_graph",
    "split_model",
    "tied_parameters",
    "trace_model",
]
