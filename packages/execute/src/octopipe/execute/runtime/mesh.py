"""One process of a pp x dp (x ep) mesh: its groups, its replica's data, its sharded stages, full tensors for reports.

A Plan with ``mesh.dp = D`` runs every pipeline rank's program on D replicas
(:mod:`octopipe.ir.mesh` maps global ranks to (pipeline rank p,
replica d)). This module is what the worker adds for that:

- **groups**: for every pipeline rank, its data-parallel group (the D replicas),
  its expert-parallel groups (``ep`` consecutive replicas) and, when
  ``1 < ep < dp``, the groups of ranks holding the *same* experts in different
  ep groups. Every process creates every group, in the same order
  (``dist.new_group`` is collective over the world).
- **data**: the global batch splits first over replicas (replica d takes the
  d-th of D equal slices), then into the plan's m micro-batches. Every replica
  scales its loss by 1/m (the interpreter does); REDUCE_GRAD's reduce-scatter
  averages over the D replicas, so a shard's gradient is that of the mean loss
  over all D*m micro-batches: exactly the single-process reference run with
  D*m micro-batches (``reference_run(num_microbatches=m * dp)``).
- **stages**: each stage on this rank becomes a :class:`MeshStage`: MoE layers
  get their experts split over the ep group first
  (:func:`octopipe.examples.models.expert_parallel`, all-to-alls inside the
  captured graphs); then every other parameter is sharded over the dp group
  (:func:`octopipe.transform.shard_parameters`), the stage is captured, and its
  all-gathers and reduce-scatters are split out into UNSHARD and REDUCE_GRAD
  graphs (:func:`octopipe.transform.split_fsdp`). Expert weights are not
  FSDP-sharded: each rank owns its experts. Their gradient on a rank already
  sums the contributions of every ep rank's tokens (the all-to-all's backward
  brings them back), each scaled by 1/m; REDUCE_GRAD sums it over the
  ``dp / ep`` ranks holding the same experts (when there are several) and
  divides by D, which again gives the gradient of the mean loss over all D*m
  micro-batches.
- **reports**: :meth:`MeshRank.full` gathers shards (and expert slices) back
  into whole tensors under the model's parameter names, so a run's gradients
  and weights compare with the reference's by name.

MoE layers are recognised as the zoo's :class:`octopipe.examples.models.MoE`;
other models run with ``ep = 1`` (everything FSDP-sharded).

Tensor and context parallelism (``mesh.tp``, ``mesh.cp``; ep = 1): the
tp ranks of a stage replica split its layers' heads and hidden units
(:mod:`octopipe.execute.runtime.tensor_parallel`, Megatron's column- then
row-parallel split; the all-reduces trace into the captured graphs) and see
the same tokens; the cp ranks hold consecutive slices of every sequence
(:mod:`octopipe.execute.runtime.context_parallel`; attention all-gathers keys
and values) and average every gradient over their group after the backward
(:meth:`MeshRank.average_split`). With ``mesh.sequence_parallel`` each tp
rank also holds 1/tp of the (context rank's) sequence between layers: layers
all-gather it at their input and reduce-scatter at their output (Megatron's
sequence parallelism), and gradients are fixed up as ``average_split`` says. With dp > 1 too, each process's tp
slices are then FSDP-sharded over its dp group (the processes with the same
pipeline, context and tensor rank). Pipeline messages go between processes
with the same (replica, context rank, tensor rank). Only the zoo's layers
(attention, SwiGLU, squared-ReLU MLP, Mamba, MoE) can be split; other models
are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist
from torch import nn

from octopipe.capture import StageGraphs, StageModule
from octopipe.execute.runtime.models import BuiltModel
from octopipe.ir import MeshSpec, mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import BWSplit, FSDPStage, ShardSpec, StageCompiler, StageExecutable, shard_parameters
from octopipe.transform.fsdp import unshard_tensor
from octopipe.transform.tensor_parallel import TPSpec, gather_tp

__all__ = ["MeshRank", "MeshStage", "context_slice", "replica_batch"]

_EXPERT_WEIGHTS = ("w1", "w2", "w3")


def context_slice(
    tokens: torch.Tensor, targets: torch.Tensor, *, cp: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context rank ``context``'s slice of every sequence (the c-th of ``cp`` equal slices along dim 1)."""
    if tokens.shape[1] % cp:
        raise ValueError(f"the sequence of {tokens.shape[1]} tokens does not split into cp={cp} equal slices")
    return tokens.chunk(cp, 1)[context].contiguous(), targets.chunk(cp, 1)[context].contiguous()


def replica_batch(
    tokens: torch.Tensor, targets: torch.Tensor, *, dp: int, replica: int, num_microbatches: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s slice of a global batch (the d-th of ``dp`` equal slices along dim 0)."""
    if tokens.shape[0] % (dp * num_microbatches):
        raise ValueError(
            f"the global batch of {tokens.shape[0]} does not split into dp={dp} replicas x "
            f"{num_microbatches} micro-batches: make it a multiple of {dp * num_microbatches}"
        )
    return tokens.chunk(dp)[replica], targets.chunk(dp)[replica]


def _gather_dim0(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    with torch.no_grad():
        out = torch.ops._c10d_functional.all_gather_into_tensor(tensor.detach().contiguous(), world, group.group_name)
        gathered: torch.Tensor = torch.ops._c10d_functional.wait_tensor(out)
    return gathered


class MeshStage:
    """A stage sharded over its data-parallel group (the interpreter's ``ShardedStage``).

    UNSHARD gathers the FSDP shards (expert weights pass through whole);
    REDUCE_GRAD reduce-scatters (mean over the dp group) the full gradients
    accumulated over the step's micro-batches, and treats expert gradients as
    the module docstring says.
    """

    def __init__(
        self,
        fsdp: FSDPStage,
        *,
        specs: Mapping[str, ShardSpec],
        experts: Sequence[str],
        dp: int,
        expert_replicas: dist.ProcessGroup | None,
    ) -> None:
        self.fsdp = fsdp
        self.specs = dict(specs)
        names = fsdp.graphs.stage.param_names
        self.expert_indices = [names.index(n) for n in experts]
        self.dp = dp
        self.expert_replicas = expert_replicas

    @property
    def graphs(self) -> StageGraphs:
        return self.fsdp.graphs.stage

    @property
    def split(self) -> BWSplit:
        return self.fsdp.split

    @property
    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.fsdp.shards, *self.fsdp.buffers]

    def unshard(self) -> StageExecutable:
        return self.fsdp.unshard()

    def reduce_grad(self, full_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        grads = self.fsdp.reduce_grad(full_grads)
        for index in self.expert_indices:
            grad = grads[index]
            if grad is None:
                continue
            if self.expert_replicas is not None:
                grad = grad.clone()
                dist.all_reduce(grad, group=self.expert_replicas)
            grads[index] = grad / self.dp
        return grads


@dataclass(eq=False)
class MeshRank:
    """This process's place in the plan's mesh and its groups (see the module docstring).

    Without a mesh (or with dp = 1) it creates no groups, and its batch,
    peers and reports are the plain runtime's.
    """

    spec: MeshSpec
    global_rank: int
    dp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    expert_replicas: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    stages: dict[int, MeshStage] = field(default_factory=dict)
    #: how each tensor-parallel parameter of this rank's stages is sliced, by name
    tp_specs: dict[str, TPSpec] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: plan_pb2.Plan, global_rank: int, world_size: int) -> MeshRank:
        """Check the mesh against the world and create every group (collective: every process calls it in turn)."""
        spec = mesh_spec(plan)
        if spec.world_size != world_size:
            raise ValueError(
                f"plan {plan.name!r} needs {spec.world_size} processes ({spec.shape}), but the "
                f"process group has {world_size}: start pp x dp x cp x tp ranks or change the plan's mesh"
            )
        rank = cls(spec=spec, global_rank=global_rank)
        if spec.tp > 1 or spec.cp > 1:
            return rank._split_groups()
        if spec.dp == 1:
            return rank
        pipeline_rank = spec.coords(global_rank)[0]
        for p in range(spec.pp):
            group = dist.new_group(list(spec.dp_group(p)))
            if p == pipeline_rank:
                rank.dp_group = group
        if spec.ep > 1:
            for p in range(spec.pp):
                for members in spec.ep_groups(p):
                    group = dist.new_group(list(members))
                    if global_rank in members:
                        rank.ep_group = group
            if spec.ep < spec.dp:
                for p in range(spec.pp):
                    groups = [sorted(g) for g in spec.ep_groups(p)]  # group ranks follow sorted global ranks
                    for k in range(spec.ep):
                        holders = [g[k] for g in groups]
                        group = dist.new_group(holders)
                        if global_rank in holders:
                            rank.expert_replicas = group
        structlog.get_logger("octopipe.mesh").info(
            "mesh_groups_created", rank=global_rank, pp=spec.pp, dp=spec.dp, ep=spec.ep, pipeline_rank=pipeline_rank
        )
        return rank

    def _split_groups(self) -> MeshRank:
        spec = self.spec
        if spec.ep > 1:
            raise ValueError(
                f"expert parallelism (ep={spec.ep}) with tp or cp > 1 is not supported (the mesh is {spec.shape}): "
                "use ep=1 (tensor parallelism splits every expert's hidden units instead)"
            )
        where = spec.position(self.global_rank)
        mine = self.global_rank

        def new_group(members: tuple[int, ...]) -> dist.ProcessGroup | None:
            return dist.new_group(list(members)) if len(members) > 1 else None

        for p in range(spec.pp):  # every process creates every group, in the same order
            for c in range(spec.cp):
                for t in range(spec.tp):
                    members = spec.dp_group(p, c, t)
                    group = new_group(members)
                    if mine in members:
                        self.dp_group = group
            for d in range(spec.dp):
                for c in range(spec.cp):
                    members = spec.tp_group(p, d, c)
                    group = new_group(members)
                    if mine in members:
                        self.tp_group = group
                for t in range(spec.tp):
                    members = spec.cp_group(p, d, t)
                    group = new_group(members)
                    if mine in members:
                        self.cp_group = group
        structlog.get_logger("octopipe.mesh").info(
            "mesh_groups_created",
            rank=self.global_rank,
            mesh=spec.shape,
            pipeline_rank=where.pp,
            cp=where.cp,
            tp=where.tp,
        )
        return self

    @property
    def split_layers(self) -> bool:
        """Whether stages are split over tensor or context ranks (tp or cp > 1)."""
        return self.spec.tp > 1 or self.spec.cp > 1

    @property
    def sharded(self) -> bool:
        """Whether stages are sharded (dp > 1)."""
        return self.spec.dp > 1

    @property
    def pipeline_rank(self) -> int:
        return self.spec.coords(self.global_rank)[0]

    @property
    def replica(self) -> int:
        return self.spec.coords(self.global_rank)[1]

    @property
    def peers(self) -> dict[int, int]:
        """Pipeline rank -> global rank at this process's (replica, context, tensor rank): where p2p messages go."""
        return self.spec.peers(self.global_rank)

    @property
    def suffix(self) -> str:
        """What tells this process's checkpoint files from those of other replicas, context and tensor ranks."""
        where, spec = self.spec.position(self.global_rank), self.spec
        parts = [f"#replica{where.dp}of{spec.dp}" if spec.dp > 1 else ""]
        parts.append(f"#cp{where.cp}of{spec.cp}" if spec.cp > 1 else "")
        parts.append(f"#tp{where.tp}of{spec.tp}" if spec.tp > 1 else "")
        return "".join(parts)

    def replica_model(self, built: BuiltModel, num_microbatches: int) -> BuiltModel:
        """``built`` whose ``batch(step)`` is this replica's slice of the global batch (and, with cp > 1, this
        context rank's slice of every sequence)."""
        if self.spec.dp == 1 and self.spec.sequence_shards == 1:
            return built
        dp, replica, full = self.spec.dp, self.replica, built.batch
        where, cp = self.spec.position(self.global_rank), self.spec.sequence_shards
        # context rank c holds the c-th of cp slices; with sequence parallelism its tensor rank t the t-th of
        # tp slices of that (slice c * tp + t of cp * tp)
        context = where.cp * self.spec.tp + where.tp if self.spec.sequence_parallel else where.cp

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            tokens, targets = full(step)
            if dp > 1:
                tokens, targets = replica_batch(
                    tokens, targets, dp=dp, replica=replica, num_microbatches=num_microbatches
                )
            if cp > 1:
                tokens, targets = context_slice(tokens, targets, cp=cp, context=context)
            return tokens, targets

        return dataclasses.replace(built, batch=batch)

    def split(self, stages: Sequence[StageModule], mine: Sequence[int], model: nn.Module) -> None:
        """Split this rank's stages of ``model`` over its context and tensor ranks, in place (cp first, then tp)."""
        from octopipe.execute.runtime.context_parallel import context_parallel  # noqa: PLC0415 (the zoo is optional)
        from octopipe.execute.runtime.tensor_parallel import split_stage  # noqa: PLC0415

        for s in mine:
            if self.cp_group is not None:
                context_parallel(stages[s], self.cp_group)
            if self.tp_group is not None:
                sequence = self.spec.sequence_parallel
                self.tp_specs.update(split_stage(stages[s], model, self.tp_group, sequence_parallel=sequence))

    def average_split(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Turn each rank's gradients of its slice of the sequence into those of the whole sequence's mean loss,
        in place (a collective: every process, same names, same order).

        Context parallelism: every gradient is averaged over the cp group. Sequence parallelism: each tp rank's
        loss is its slice's mean, and the collectives' gradients bring every rank's loss to every slice, so a
        tensor-parallel slice's gradient is divided by tp and a replicated parameter's (norms, embedding, head:
        each rank's holds its slice's share) is averaged over the tp group."""
        if self.cp_group is not None:
            for grad in grads.values():
                if grad is not None:
                    dist.all_reduce(grad, group=self.cp_group)
                    grad.div_(self.spec.cp)
        if self.spec.sequence_parallel and self.tp_group is not None:
            for name, grad in grads.items():
                if grad is None:
                    continue
                if name not in self.tp_specs:
                    dist.all_reduce(grad, group=self.tp_group)
                grad.div_(self.spec.tp)

    def counts_norm(self, name: str) -> bool:
        """Whether this process adds ``name``'s gradient to a clipped global norm: a tensor-parallel slice on
        every tensor rank, a replicated tensor on tensor rank 0 only, and on context rank 0 only."""
        where = self.spec.position(self.global_rank)
        return where.cp == 0 and (where.tp == 0 or name in self.tp_specs)

    def compile(
        self,
        stages: Sequence[StageModule],
        inputs: Mapping[int, list[torch.Tensor]],
        compiler: StageCompiler,
        model: nn.Module,
    ) -> dict[int, MeshStage]:
        """Shard (and expert-split) ``stages[s]`` for each ``s`` in ``inputs`` in place and compile it with
        ``compiler`` (capture, UNSHARD / REDUCE_GRAD split, B/W split); a collective over the dp (and ep)
        group, so every replica calls it in turn."""
        assert self.dp_group is not None, "compile is for dp > 1"
        self.split(stages, sorted(inputs), model)  # tp / cp slices first (a no-op without them); FSDP shards them
        for s in sorted(inputs):
            stage = stages[s]
            experts = self._split_experts(stage)
            specs = shard_parameters(stage, self.dp_group, exclude=experts)
            fsdp = compiler.fsdp_stage(stage, inputs[s], stage_index=s)
            self.stages[s] = MeshStage(
                fsdp, specs=specs, experts=experts, dp=self.spec.dp, expert_replicas=self.expert_replicas
            )
        return dict(self.stages)

    def _split_experts(self, stage: nn.Module) -> list[str]:
        if self.ep_group is None:
            return []
        from octopipe.examples.models import MoE, expert_parallel  # noqa: PLC0415 (the zoo is optional)
        from octopipe.examples.models.expert_parallel import ExpertParallelMoE  # noqa: PLC0415

        if not any(type(m) is MoE for m in stage.modules()):
            return []
        expert_parallel(stage, self.ep_group)
        return [
            f"{prefix}.{name}"
            for prefix, module in stage.named_modules()
            if isinstance(module, ExpertParallelMoE)
            for name in _EXPERT_WEIGHTS
        ]

    def full(self, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors for this rank's shards and slices, by parameter name (collective over the dp, ep and tp
        groups).

        Every replica of a pipeline rank must call it with the same names in the same order.
        """
        specs = {n: spec for stage in self.stages.values() for n, spec in stage.specs.items()}
        experts = {stage.graphs.param_names[i] for stage in self.stages.values() for i in stage.expert_indices}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in named.items():
            if name in specs:
                value = unshard_tensor(tensor, specs[name])
            elif name in experts:
                assert self.ep_group is not None
                value = _gather_dim0(tensor, self.ep_group)
            else:
                value = tensor.detach().clone()
            out[name] = gather_tp(value, self.tp_specs[name]) if name in self.tp_specs else value
        return out
