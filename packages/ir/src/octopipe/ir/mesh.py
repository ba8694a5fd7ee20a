"""The device mesh of a Plan: pp x dp x cp x tp, with expert parallelism inside dp.

A plan without a ``mesh`` runs one process per pipeline rank. With a mesh,
every pipeline rank's program runs on ``dp`` replicas; the replicas of
pipeline rank ``p`` form the data-parallel (FSDP) group of the stages placed on
``p``, and MoE layers split their experts over ``ep`` consecutive members of
that group. Inside each replica, ``cp`` context ranks hold consecutive slices
of every sequence and ``tp`` tensor ranks split the heads and hidden units of
each layer (tp innermost: consecutive global ranks, one node's fast links).
Pipeline sends and receives go between processes with the same (replica,
context rank, tensor rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from octopipe.ir.plan_error import PlanError
from octopipe.plan.v1 import plan_pb2

__all__ = ["MAX_WORLD_SIZE", "MeshCoord", "MeshSpec", "check_mesh_model", "mesh_spec"]

#: the largest mesh a plan may describe (pp x dp x cp x tp processes)
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class MeshCoord:
    """Where one process sits: pipeline rank, replica, context rank, tensor rank."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class MeshSpec:
    """A checked mesh: ``global_ranks[((p * dp + d) * cp + c) * tp + t]`` is the process at (p, d, c, t)."""

    pp: int
    dp: int
    ep: int
    global_ranks: tuple[int, ...]
    tp: int = 1
    cp: int = 1
    #: Megatron sequence parallelism over the tp ranks (the proto's ``sequence_parallel``)
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> str:
        """``pp=2 x dp=1 x cp=1 x tp=2`` (for messages; ``+sp`` with sequence parallelism)."""
        return f"pp={self.pp} x dp={self.dp} x cp={self.cp} x tp={self.tp}" + ("+sp" if self.sequence_parallel else "")

    @property
    def sequence_shards(self) -> int:
        """How many slices of every sequence the ranks of one replica hold between layers: cp (x tp with sp)."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    def global_rank(self, pipeline_rank: int, replica: int, context: int = 0, tensor: int = 0) -> int:
        """The torch.distributed rank of one (pipeline rank, replica, context rank, tensor rank)."""
        if not (
            0 <= pipeline_rank < self.pp and 0 <= replica < self.dp and 0 <= context < self.cp and 0 <= tensor < self.tp
        ):
            raise PlanError(
                f"mesh coordinate (pp {pipeline_rank}, dp {replica}, cp {context}, tp {tensor}) is outside the "
                f"{self.shape} mesh"
            )
        return self.global_ranks[((pipeline_rank * self.dp + replica) * self.cp + context) * self.tp + tensor]

    def position(self, global_rank: int) -> MeshCoord:
        """The (pipeline rank, replica, context rank, tensor rank) of a global rank."""
        try:
            index = self.global_ranks.index(global_rank)
        except ValueError:
            raise PlanError(f"global rank {global_rank} is not in the mesh of {self.world_size} ranks") from None
        rest, tensor = divmod(index, self.tp)
        rest, context = divmod(rest, self.cp)
        pipeline_rank, replica = divmod(rest, self.dp)
        return MeshCoord(pp=pipeline_rank, dp=replica, cp=context, tp=tensor)

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(pipeline rank, replica) of a global rank."""
        where = self.position(global_rank)
        return where.pp, where.dp

    def dp_group(self, pipeline_rank: int, context: int = 0, tensor: int = 0) -> tuple[int, ...]:
        """The global ranks holding replicas of ``pipeline_rank`` (same context and tensor rank), in replica order."""
        return tuple(self.global_rank(pipeline_rank, d, context, tensor) for d in range(self.dp))

    def tp_group(self, pipeline_rank: int, replica: int, context: int = 0) -> tuple[int, ...]:
        """The global ranks that split one stage replica's layers, in tensor-rank order."""
        return tuple(self.global_rank(pipeline_rank, replica, context, t) for t in range(self.tp))

    def cp_group(self, pipeline_rank: int, replica: int, tensor: int = 0) -> tuple[int, ...]:
        """The global ranks that hold one stage replica's sequence slices, in context-rank order."""
        return tuple(self.global_rank(pipeline_rank, replica, c, tensor) for c in range(self.cp))

    def peers(self, global_rank: int) -> dict[int, int]:
        """Pipeline rank -> the global rank at ``global_rank``'s (replica, context, tensor) there: p2p partners."""
        where = self.position(global_rank)
        return {p: self.global_rank(p, where.dp, where.cp, where.tp) for p in range(self.pp)}

    def ep_groups(self, pipeline_rank: int) -> tuple[tuple[int, ...], ...]:
        """The expert-parallel groups of ``pipeline_rank``: ``ep`` consecutive replicas each."""
        group = self.dp_group(pipeline_rank)
        return tuple(group[start : start + self.ep] for start in range(0, self.dp, self.ep))

    def ep_group_of(self, global_rank: int) -> tuple[int, ...]:
        """The expert-parallel group ``global_rank`` belongs to."""
        pipeline_rank, replica = self.coords(global_rank)
        return self.ep_groups(pipeline_rank)[replica // self.ep]

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The global ranks of one pipeline replica (one per pipeline rank), in pipeline order."""
        return tuple(self.global_rank(p, replica) for p in range(self.pp))


def mesh_spec(plan: plan_pb2.Plan) -> MeshSpec:
    """The plan's mesh, checked; a plan without one gets dp = ep = cp = tp = 1.

    Raises PlanError saying what to change when ep does not divide dp or the
    global rank map is not a permutation of 0..pp*dp*cp*tp-1.
    """
    pp = len(plan.ranks)
    if not plan.HasField("mesh"):
        return MeshSpec(pp=pp, dp=1, ep=1, global_ranks=tuple(range(pp)))
    mesh = plan.mesh
    dp, ep, tp, cp = mesh.dp or 1, mesh.ep or 1, mesh.tp or 1, mesh.cp or 1
    if dp % ep:
        raise PlanError(f"mesh ep={ep} does not divide dp={dp}: choose an expert-parallel degree that divides dp")
    world = pp * dp * cp * tp
    shape = f"pp={pp} x dp={dp} x cp={cp} x tp={tp}"
    if world > MAX_WORLD_SIZE:
        raise PlanError(f"the mesh {shape} has {world} ranks; at most {MAX_WORLD_SIZE} are supported: lower dp")
    if mesh.global_ranks:
        ranks = tuple(mesh.global_ranks)
        if len(ranks) != world:
            raise PlanError(
                f"mesh.global_ranks has {len(ranks)} entries, but {shape} needs {world} "
                "(one per (pipeline rank, replica, context rank, tensor rank), at index ((p * dp + d) * cp + c) * tp + t)"
            )
        if sorted(ranks) != list(range(world)):
            raise PlanError(f"mesh.global_ranks must be a permutation of 0..{world - 1}, got {list(ranks)}")
    else:
        ranks = tuple(range(world))
    if mesh.sequence_parallel and tp == 1:
        raise PlanError("mesh.sequence_parallel splits the sequence over the tp ranks, but tp=1: set tp > 1 or drop it")
    return MeshSpec(pp=pp, dp=dp, ep=ep, global_ranks=ranks, tp=tp, cp=cp, sequence_parallel=mesh.sequence_parallel)


def check_mesh_model(spec: MeshSpec, facts: Mapping[str, int]) -> None:
    """Refuse a mesh the model cannot be split over, in one line: what does not divide what, and what to change.

    ``facts`` are the model's sizes that tp and cp must divide, by name:
    ``heads`` (attention heads), ``mamba_heads``, ``ffn`` / ``mlp_ffn``
    (MLP hidden units), ``vocab`` (an embedding and head split by vocabulary,
    without sequence parallelism) and ``sequence``; a fact the
    model does not have is left out (or 0). ``mamba_layers`` > 0 with cp > 1 is
    refused: a Mamba scan runs the whole sequence in order.
    """
    names = ("heads", "mamba_heads", "ffn", "mlp_ffn") + (() if spec.sequence_parallel else ("vocab",))
    for name in names:
        size = facts.get(name, 0)
        if spec.tp > 1 and size and size % spec.tp:
            raise PlanError(
                f"mesh tp={spec.tp} does not divide the model's {name}={size}: choose a tp that divides {size}"
            )
    sequence = facts.get("sequence", 0)
    if spec.cp > 1 and sequence and sequence % spec.cp:
        raise PlanError(
            f"mesh cp={spec.cp} does not divide the sequence length {sequence}: choose a cp that divides {sequence}"
        )
    shards = spec.sequence_shards
    if spec.sequence_parallel and sequence and sequence % shards:
        raise PlanError(
            f"sequence parallelism splits the sequence of {sequence} over cp x tp = {shards} ranks, which does not "
            f"divide it: choose tp and cp whose product divides {sequence}"
        )
    if spec.sequence_parallel and facts.get("moe_layers", 0):
        raise PlanError(
            "sequence parallelism with MoE layers is not supported (each rank would route its own slice of the "
            "tokens, with other expert capacities than the model's): drop sequence_parallel"
        )
    if spec.cp > 1 and facts.get("mamba_layers", 0):
        raise PlanError(
            f"mesh cp={spec.cp} splits the sequence, but the model has {facts['mamba_layers']} Mamba layer(s), whose "
            "scan needs the whole sequence in order: use cp=1 for this model"
        )
