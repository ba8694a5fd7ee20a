"""The device mesh of a Plan: pp x dp, with expert parallelism inside dp.

A plan without a ``mesh`` runs one process per pipeline rank. With a mesh,
every pipeline rank's program runs on ``dp`` replicas; the replicas of
pipeline rank ``p`` form the data-parallel (FSDP) group of the stages placed on
``p``, and MoE layers split their experts over ``ep`` consecutive members of
that group. Pipeline sends and receives go between replicas with the same
data-parallel index.
"""

from __future__ import annotations

from dataclasses import dataclass

from octopipe.ir.plan_error import PlanError
from octopipe.plan.v1 import plan_pb2

__all__ = ["MAX_WORLD_SIZE", "MeshSpec", "mesh_spec"]

#: the largest mesh a plan may describe (pp x dp processes)
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class MeshSpec:
    """A checked mesh: ``global_ranks[p * dp + d]`` is the process of pipeline rank p, replica d."""

    pp: int
    dp: int
    ep: int
    global_ranks: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def global_rank(self, pipeline_rank: int, replica: int) -> int:
        """The torch.distributed rank of one replica of one pipeline rank."""
        if not (0 <= pipeline_rank < self.pp and 0 <= replica < self.dp):
            raise PlanError(
                f"mesh coordinate (pp {pipeline_rank}, dp {replica}) is outside the {self.pp} x {self.dp} mesh"
            )
        return self.global_ranks[pipeline_rank * self.dp + replica]

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(pipeline rank, replica) of a global rank."""
        try:
            index = self.global_ranks.index(global_rank)
        except ValueError:
            raise PlanError(f"global rank {global_rank} is not in the mesh of {self.world_size} ranks") from None
        return divmod(index, self.dp)

    def dp_group(self, pipeline_rank: int) -> tuple[int, ...]:
        """The global ranks holding replicas of ``pipeline_rank``, in replica order."""
        return tuple(self.global_rank(pipeline_rank, d) for d in range(self.dp))

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
    """The plan's mesh, checked; a plan without one gets dp = ep = 1.

    Raises PlanError saying what to change when ep does not divide dp or the
    global rank map is not a permutation of 0..pp*dp-1.
    """
    pp = len(plan.ranks)
    if not plan.HasField("mesh"):
        return MeshSpec(pp=pp, dp=1, ep=1, global_ranks=tuple(range(pp)))
    mesh = plan.mesh
    dp = mesh.dp or 1
    ep = mesh.ep or 1
    if dp % ep:
        raise PlanError(f"mesh ep={ep} does not divide dp={dp}: choose an expert-parallel degree that divides dp")
    world = pp * dp
    if world > MAX_WORLD_SIZE:
        raise PlanError(
            f"the mesh pp={pp} x dp={dp} has {world} ranks; at most {MAX_WORLD_SIZE} are supported: lower dp"
        )
    if mesh.global_ranks:
        ranks = tuple(mesh.global_ranks)
        if len(ranks) != world:
            raise PlanError(
                f"mesh.global_ranks has {len(ranks)} entries, but pp={pp} x dp={dp} needs {world} "
                "(one per (pipeline rank, replica), at index p * dp + d)"
            )
        if sorted(ranks) != list(range(world)):
            raise PlanError(f"mesh.global_ranks must be a permutation of 0..{world - 1}, got {list(ranks)}")
    else:
        ranks = tuple(range(world))
    return MeshSpec(pp=pp, dp=dp, ep=ep, global_ranks=ranks)
