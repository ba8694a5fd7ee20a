"""One rank's stages of a plan, compiled: the modules, their example inputs, and the executables.

The worker calls :func:`rank_stages` once per plan. Layer-list models are
split at the plan's layer boundaries (``capture.split_model``); a model
captured as written is traced whole and cut there (``whole_model_stages``).
A model whose parameters are on the meta device (loaded stage by stage, ``runtime.pretrained``) is
captured and split with storage-free placeholders in their place (zeros expanded from one element: the
graphs record ops on the rank's device, never the meta device); then ``materialize`` gives this rank's
stages their tensors, and they are compiled on zeros shaped like their inputs (capture depends on
shapes, not values).
Every stage goes through the run's :class:`~octopipe.transform.StageCompiler`
(the profiler's too), sharded stages through the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture import CaptureConfig, StageModule, split_model
from octopipe.execute.runtime.interpreter import ShardedStage
from octopipe.execute.runtime.mesh import MeshRank
from octopipe.execute.runtime.models import BuiltModel
from octopipe.execute.runtime.pretrained import placeholders
from octopipe.execute.runtime.whole_model import (
    Boundaries,
    WholeModelStages,
    graph_boundaries,
    layer_boundaries,
    whole_model_stages,
)
from octopipe.ir import recompute_of
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import StageCompiler, StageExecutable

__all__ = ["RankStages", "capture_config", "rank_stages", "split_batch", "stage_key"]


def capture_config(stage: plan_pb2.Stage, base: CaptureConfig | None) -> CaptureConfig | None:
    """The capture configuration of one plan stage: ``base`` with the stage's recomputation policy."""
    policy = recompute_of(stage)
    if policy.policy == "none":
        return base
    base = base or CaptureConfig()
    return CaptureConfig(
        route=base.route,
        partitioner=base.partitioner,
        recompute=policy.policy,
        activation_budget=policy.activation_budget,
    )


def split_batch(tokens: torch.Tensor, targets: torch.Tensor, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A global batch as ``m`` equal micro-batches; a batch that does not split is refused."""
    if tokens.shape[0] % m:
        raise ValueError(f"the global batch of {tokens.shape[0]} does not split into {m} equal micro-batches")
    return list(zip(tokens.chunk(m), targets.chunk(m), strict=True))


def stage_key(stage: nn.Module, inputs: Sequence[torch.Tensor], model: bytes) -> tuple[object, ...]:
    """What a stage's compiled graphs depend on: its layers, whether it ends in the loss, its input shapes and,
    for a whole-model stage, its model and the tensors crossing its boundaries (plans of a run share them)."""
    boundary = (model, getattr(stage, "input_names", None), getattr(stage, "output_names", None))
    layers = getattr(stage, "layer_names", None)
    shapes = tuple(tuple(p.shape) for p in stage.parameters())  # a tensor-parallel slice has other shapes
    return (layers, getattr(stage, "is_last", None), boundary, tuple((tuple(x.shape), x.dtype) for x in inputs), shapes)


@dataclass(frozen=True, eq=False)
class RankStages:
    """Every stage module of the plan, the executables of this rank's, and what crosses stage boundaries."""

    modules: list[StageModule]
    #: this rank's stages: bound executables, or sharded stages (gathered by UNSHARD actions)
    executables: dict[int, StageExecutable | ShardedStage]
    #: the tensors crossing each stage boundary, for the receive buffers (``whole_model.buffer_specs``)
    boundaries: Boundaries
    #: the whole-model capture when the model is captured as written
    whole: WholeModelStages | None
    #: the first micro-batch (tokens, targets): the example the shapes came from
    first: tuple[torch.Tensor, torch.Tensor]


#: gives this rank's stages (``mine``) of the split model their parameters (``runtime.pretrained.materialize``)
Materialize = Callable[[Sequence[nn.Module], Sequence[int]], None]


def rank_stages(
    plan: plan_pb2.Plan,
    built: BuiltModel,
    mine: Sequence[int],
    mesh: MeshRank,
    compiler: StageCompiler,
    materialize: Materialize | None = None,
) -> RankStages:
    """Split ``built``'s model at ``plan``'s layer boundaries and compile the stages in ``mine`` with ``compiler``.

    One eager forward of the first micro-batch gives capture its shapes. A mesh with dp > 1 shards the
    stages first (a collective over the dp group). A model with meta parameters needs ``materialize``."""
    m = plan.num_microbatches
    partition = [list(s.layer_names) for s in plan.stages]
    first = split_batch(*built.batch(0), m)[0]
    on_meta = any(p.is_meta for p in built.model.parameters())
    if on_meta and materialize is None:
        raise ValueError("the model's parameters are on the meta device: give rank_stages a materialize")
    if on_meta:
        placeholders(built.model, first[0].device)
    whole = None
    model_key = b""  # layer-list stages: keyed by their layers and shapes
    stages: list[StageModule]
    if built.input_names is not None:  # the model's forward as written, split at the plan's layer boundaries
        if mesh.spec.dp > 1 or mesh.spec.ep > 1:
            raise ValueError("a whole-model capture runs without a mesh (dp = ep = 1): drop the plan's mesh")
        whole = whole_model_stages(built.model, built.input_names, first, partition)
        model_key = plan.model.SerializeToString(deterministic=True)
        stages = list(whole.stages)
        inputs = {s: whole.examples[s] for s in mine}
        boundaries = graph_boundaries(whole)
    else:
        stages = list(split_model(built.model, partition))
        activations = [first[0]]
        with torch.no_grad():
            for stage in stages[:-1]:
                activations.append(stage(activations[-1]))
        inputs = {s: [activations[s], first[1]] if s == len(stages) - 1 else [activations[s]] for s in mine}
        boundaries = layer_boundaries(stages, activations)
    if materialize is not None and on_meta:
        materialize(stages, mine)
    executables: dict[int, StageExecutable | ShardedStage]
    recomputing = [s for s in mine if recompute_of(plan.stages[s]).policy != "none"]
    if recomputing and (mesh.sharded or mesh.split_layers):
        raise ValueError(
            f"stages {recomputing} recompute activations, which this version runs only without a mesh "
            "(dp = tp = cp = ep = 1: the backward would repeat the mesh's collectives): drop their recompute "
            "policy or the mesh"
        )
    if mesh.sharded:
        executables = dict(mesh.compile(stages, inputs, compiler, built.model))
    else:
        if mesh.split_layers:  # tp / cp > 1: this rank's slices of its stages; the collectives trace into the graphs
            if whole is not None:
                raise ValueError(
                    "tensor and context parallelism split the zoo's layers (layer-list stages); a whole-model "
                    "capture runs with tp = cp = 1: drop them from the plan's mesh"
                )
            mesh.split(stages, mine, built.model)
        executables = {
            s: compiler.executable(
                stages[s],
                inputs[s],
                stage_index=s,
                key=stage_key(stages[s], inputs[s], model_key),
                config=capture_config(plan.stages[s], compiler.config),
            )
            for s in mine
        }
    return RankStages(modules=stages, executables=executables, boundaries=boundaries, whole=whole, first=first)
