"""The stage compiler: the one road from a stage module to the graphs a runtime runs.

capture -> [FSDP split] -> B/W split -> [multiplex the overlap pairs a plan
names] -> executable stage. The worker, the mesh runtime and the profiler all
compile through a :class:`StageCompiler`, so the profiler times the graphs the
runtime runs, and a new graph pass is added here, in one place.

A :class:`CompiledStage` holds graphs only (no parameters); binding it to a
module's tensors gives a :class:`StageExecutable` (or an :class:`FSDPStage`
for sharded parameters). A compiler caches compiled stages by a key the
caller gives (the same stage and input shapes across plans of a run), and
multiplexed graphs by the pair of stages and the backward kind.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from octopipe.capture import CaptureConfig, StageGraphs, capture_stage
from octopipe.transform.bw_split import BWSplit, split_backward
from octopipe.transform.compile_cache import CompileIndex
from octopipe.transform.costs import roofline_costs
from octopipe.transform.executable import StageExecutable
from octopipe.transform.fsdp import shard_specs
from octopipe.transform.fsdp_bucket import BucketPolicy, bucket_collectives
from octopipe.transform.fsdp_split import FSDPGraphs, FSDPStage, split_fsdp
from octopipe.transform.inductor import Backend, CompileError, auto_stage_graphs, compile_graph, compile_stage_graphs
from octopipe.transform.multiplexing import Multiplexed, multiplex
from octopipe.transform.overlap import OverlapStage

__all__ = ["BackwardKind", "CompiledStage", "StageCompiler", "compile_fsdp_stage", "compile_stage"]

#: which backward an OVERLAP_F_B multiplexes with the forward: the fused one or B (input gradients)
BackwardKind = Literal["full", "input"]


@dataclass(frozen=True, eq=False)
class CompiledStage:
    """One stage after every pass, without parameters.

    ``graphs`` are the graphs F, B and W run (for a sharded stage: on the
    gathered parameters), ``split`` their B/W split, ``fsdp`` the UNSHARD and
    REDUCE_GRAD graphs when the stage's parameters are sharded.
    """

    graphs: StageGraphs
    split: BWSplit
    fsdp: FSDPGraphs | None = None

    def bind(self, stage: nn.Module) -> StageExecutable:
        """An executable on ``stage``'s current parameters and buffers (shared storage)."""
        if self.fsdp is not None:
            raise ValueError("this stage was compiled with sharded parameters: bind it with bind_sharded")
        params, buffers = dict(stage.named_parameters()), dict(stage.named_buffers())
        return StageExecutable(
            self.graphs,
            self.split,
            [params[n] for n in self.graphs.param_names],
            [buffers[n] for n in self.graphs.buffer_names],
        )

    def bind_sharded(self, stage: nn.Module) -> FSDPStage:
        """An FSDP stage on ``stage``'s current parameter shards and buffers (shared storage)."""
        if self.fsdp is None:
            raise ValueError("this stage was compiled without sharded parameters: bind it with bind")
        return FSDPStage.from_module(stage, self.fsdp, split=self.split)


@dataclass(eq=False)
class StageCompiler:
    """Compiles stages (cached by the caller's key) and multiplexes overlap pairs (cached by the pair).

    ``config`` is the capture configuration every stage is captured with.
    One compiler serves a whole run: a plan switch that keeps a stage's
    layers and shapes reuses its graphs.
    """

    config: CaptureConfig | None = None
    #: how a sharded stage's collectives are bucketed (default: one all-gather and one reduce-scatter per stage)
    buckets: BucketPolicy = field(default_factory=BucketPolicy)
    #: ``inductor``: each stage's F, B, I and W graphs, and each multiplexed OVERLAP_F_B graph, compiled
    #: (``transform.inductor``), each compiled graph's times recorded in ``index``; ``auto``: a stage's graphs
    #: compiled only where ``index`` has seen all of them and only those that ran faster compiled
    #: (``transform.compile_cache``; multiplexed graphs stay as captured); ``fallback``: a graph that fails to
    #: compile runs eagerly (with a warning) instead of raising CompileError (always so under ``auto``)
    backend: Backend = "eager"
    fallback: bool = False
    index: CompileIndex = field(default_factory=CompileIndex)
    #: stage index -> one line saying what runs compiled (``inductor`` and ``auto``), for the run's report
    notes: dict[int, str] = field(default_factory=dict)
    #: the stages with at least one graph compiled (their results agree with eager to rounding, not bitwise)
    compiled_stages: set[int] = field(default_factory=set)
    _stages: dict[Hashable, CompiledStage] = field(default_factory=dict, repr=False)
    _multiplexed: dict[tuple[int, int, str], tuple[StageGraphs, StageGraphs, Multiplexed]] = field(
        default_factory=dict, repr=False
    )

    @property
    def compiled(self) -> dict[Hashable, CompiledStage]:
        """The compiled stages by key (a copy)."""
        return dict(self._stages)

    def compile(
        self,
        stage: nn.Module,
        inputs: Sequence[torch.Tensor],
        *,
        stage_index: int,
        sharded: bool = False,
        key: Hashable | None = None,
        config: CaptureConfig | None = None,
    ) -> CompiledStage:
        """Capture ``stage`` on ``inputs`` and run the passes; reuse the result for a key seen before.

        ``config`` replaces the compiler's capture configuration for this stage (a plan's per-stage
        recomputation policy); it is part of the cache key.

        ``sharded``: the stage's parameters are FSDP shards (``shard_parameters``): the capture
        holds their all-gathers and reduce-scatters, split out here as UNSHARD and REDUCE_GRAD and
        bucketed by ``buckets``.
        Without ``key`` nothing is cached.
        """
        config = config or self.config
        if sharded and config is not None and config.recompute != "none":
            raise ValueError(
                f"stage {stage_index}: recomputation ({config.recompute}) with FSDP-sharded parameters is not "
                "supported (the backward would gather the parameters again): drop the stage's recompute policy or "
                "the mesh's dp sharding"
            )
        cache_key = (key, sharded, config) if key is not None else None
        if cache_key is not None and cache_key in self._stages:
            return self._stages[cache_key]
        graphs = capture_stage(stage, list(inputs), config=config, stage_index=stage_index)
        # parameter collectives are those over the groups the shards name; tp / cp activations' stay in F and B
        groups = {spec.group_name for spec in shard_specs(stage).values()} if sharded else None
        fsdp = bucket_collectives(split_fsdp(graphs, groups=groups or None), self.buckets) if sharded else None
        runs = fsdp.stage if fsdp is not None else graphs
        split = split_backward(runs.backward, num_params=runs.num_params, num_inputs=runs.num_inputs)
        if self.backend == "inductor":
            runs, split = compile_stage_graphs(
                runs, split, stage_index=stage_index, fallback=self.fallback, index=self.index
            )
            self.notes[stage_index] = f"stage {stage_index}: compiled (Inductor)"
            self.compiled_stages.add(stage_index)
        elif self.backend == "auto":
            runs, split, self.notes[stage_index], count = auto_stage_graphs(
                runs, split, stage_index=stage_index, index=self.index
            )
            if count:
                self.compiled_stages.add(stage_index)
        if fsdp is not None:
            fsdp = dataclasses.replace(fsdp, stage=runs)
        compiled = CompiledStage(graphs=runs, split=split, fsdp=fsdp)
        if cache_key is not None:
            self._stages[cache_key] = compiled
        return compiled

    def executable(
        self,
        stage: nn.Module,
        inputs: Sequence[torch.Tensor],
        *,
        stage_index: int,
        key: Hashable | None = None,
        config: CaptureConfig | None = None,
    ) -> StageExecutable:
        """Compile (or reuse) and bind to ``stage``'s parameters."""
        return self.compile(stage, inputs, stage_index=stage_index, key=key, config=config).bind(stage)

    def fsdp_stage(
        self,
        stage: nn.Module,
        inputs: Sequence[torch.Tensor],
        *,
        stage_index: int,
        key: Hashable | None = None,
        config: CaptureConfig | None = None,
    ) -> FSDPStage:
        """Compile (or reuse) a stage whose parameters are sharded, and bind it to its shards."""
        compiled = self.compile(stage, inputs, stage_index=stage_index, sharded=True, key=key, config=config)
        return compiled.bind_sharded(stage)

    def overlap(self, forward: StageExecutable, backward: StageExecutable, kind: BackwardKind) -> OverlapStage:
        """The OVERLAP_F_B stage for two bound stages, on the (cached) multiplexed graph of their graphs."""
        graph = self.multiplexed(forward.graphs, backward.graphs, backward.split, kind)
        return OverlapStage(forward, backward, backward=kind, multiplexed=graph)

    def multiplexed(
        self,
        forward: StageGraphs,
        backward: StageGraphs,
        split: BWSplit,
        kind: BackwardKind,
        *,
        stages: tuple[int, int] | None = None,
    ) -> Multiplexed:
        """F of ``forward`` and the backward (``kind``; ``split`` is ``backward``'s B/W split) as one graph
        ordered for overlap; made once per pair of graphs and kind. A runtime calls it for the overlap pairs
        its plan names when it starts the plan, so no graph is built mid-step. ``stages`` (the F and the
        backward stage's indices) names the graph in a compile error."""
        if kind not in ("full", "input"):
            raise ValueError(f"backward kind must be 'full' or 'input', got {kind!r}")
        key = (id(forward), id(backward), kind)
        cached = self._multiplexed.get(key)
        if cached is not None and cached[0] is forward and cached[1] is backward:
            return cached[2]
        graph = backward.backward if kind == "full" else split.backward_input
        result = multiplex(forward.forward, graph, costs=roofline_costs())
        if self.backend == "inductor":
            result = dataclasses.replace(result, graph=self._compile_multiplexed(result.graph, kind, stages))
        self._multiplexed[key] = (forward, backward, result)  # holds the graphs, so their ids stay theirs
        return result

    def _compile_multiplexed(
        self, graph: torch.fx.GraphModule, kind: BackwardKind, stages: tuple[int, int] | None
    ) -> torch.fx.GraphModule:
        """The multiplexed graph compiled (in segments between its collectives, which keep their order)."""
        pair = f"F of stage {stages[0]} with {'B' if kind == 'full' else 'I'} of stage {stages[1]}" if stages else ""
        what = f"OVERLAP_F_B graph {pair or f'(F with the {kind} backward)'}"
        try:
            return compile_graph(graph, what)
        except CompileError as exc:
            if not self.fallback:
                raise
            warnings.warn(f"{exc}; running it eagerly (fallback asked for)", stacklevel=3)
            return graph


def compile_stage(
    stage: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    config: CaptureConfig | None = None,
    stage_index: int = 0,
) -> StageExecutable:
    """Capture ``stage``, split its backward and bind it: one stage through a fresh :class:`StageCompiler`."""
    return StageCompiler(config=config).executable(stage, example_inputs, stage_index=stage_index)


def compile_fsdp_stage(
    stage: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    config: CaptureConfig | None = None,
    stage_index: int = 0,
) -> FSDPStage:
    """Capture a stage whose parameters are sharded, split its collectives out, and bind it (a collective call)."""
    return StageCompiler(config=config).fsdp_stage(stage, example_inputs, stage_index=stage_index)
