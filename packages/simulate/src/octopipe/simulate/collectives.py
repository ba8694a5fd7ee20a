"""Collective costs over the groups of a plan's device mesh.

Formulas (ring algorithms; pairwise exchange for all-to-all). A collective
over ``n`` ranks on a group whose slowest hop has bandwidth ``bw`` (bytes per
second each rank sends) and latency ``lat`` per step, for a tensor of ``B``
bytes (the whole, unsharded tensor):

* all-gather and reduce-scatter: ``(n-1)/n * B / bw + (n-1) * lat``: each rank
  sends (and receives) n-1 of the n shards, one ring step each;
* all-reduce (a reduce-scatter then an all-gather): twice that;
* all-to-all of ``B`` bytes per rank: ``(n-1)/n * B / bw + (n-1) * lat``: each
  rank keeps 1/n of its bytes and exchanges the rest with the n-1 others.

A group of one rank costs nothing (no latency either). :class:`GroupLinks`
holds the (latency, bandwidth) of each kind of group, per pipeline rank or for
all of them, as a Profile's ``CollectiveCost`` entries give them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.costs import Link

__all__ = ["GroupLinks", "all_gather_us", "all_reduce_us", "all_to_all_us", "reduce_scatter_us"]


def _ring_us(link: Link, group_size: int, num_bytes: int) -> float:
    if group_size < 1:
        raise ValueError(f"a group has at least one rank, got {group_size}")
    if num_bytes < 0:
        raise ValueError(f"bytes must be >= 0, got {num_bytes}")
    if group_size == 1:
        return 0.0
    steps = group_size - 1
    return steps / group_size * num_bytes / link.bandwidth_bytes_per_second * 1e6 + steps * link.latency_us


def all_gather_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Ring all-gather of a ``num_bytes`` tensor over ``group_size`` ranks: (n-1)/n * B / bw + (n-1) * lat."""
    return _ring_us(link, group_size, num_bytes)


def reduce_scatter_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Ring reduce-scatter of a ``num_bytes`` tensor over ``group_size`` ranks: same as the all-gather."""
    return _ring_us(link, group_size, num_bytes)


def all_reduce_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2 * ((n-1)/n * B / bw + (n-1) * lat)."""
    return 2.0 * _ring_us(link, group_size, num_bytes)


def all_to_all_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Pairwise all-to-all of ``num_bytes`` per rank: (n-1)/n * B / bw + (n-1) * lat."""
    return _ring_us(link, group_size, num_bytes)


@dataclass(kw_only=True, frozen=True)
class GroupLinks:
    """The hop cost of each kind of mesh group: data-parallel (FSDP) and expert-parallel.

    ``data_parallel`` / ``expert_parallel`` apply to every pipeline rank's
    groups; ``*_by_rank`` override them for one pipeline rank.
    """

    data_parallel: Link | None = None
    expert_parallel: Link | None = None
    data_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)
    expert_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)

    def data_parallel_link(self, pipeline_rank: int) -> Link:
        """The hop cost of ``pipeline_rank``'s data-parallel group."""
        found = self.data_parallel_by_rank.get(pipeline_rank, self.data_parallel)
        if found is None:
            raise ValueError(
                f"no data-parallel collective cost for pipeline rank {pipeline_rank}: add a CollectiveCost "
                "(group GROUP_KIND_DATA_PARALLEL) to the profile, or set GroupLinks.data_parallel"
            )
        return found

    def expert_parallel_link(self, pipeline_rank: int) -> Link:
        """The hop cost of ``pipeline_rank``'s expert-parallel groups."""
        found = self.expert_parallel_by_rank.get(pipeline_rank, self.expert_parallel)
        if found is None:
            raise ValueError(
                f"no expert-parallel collective cost for pipeline rank {pipeline_rank}: add a CollectiveCost "
                "(group GROUP_KIND_EXPERT_PARALLEL) to the profile, or set GroupLinks.expert_parallel"
            )
        return found

    @classmethod
    def from_profile(cls, profile: profile_pb2.Profile) -> GroupLinks | None:
        """The profile's ``collectives`` (None when it has none)."""
        if not profile.collectives:
            return None
        shared: dict[int, Link] = {}
        by_rank: dict[int, dict[int, Link]] = {
            profile_pb2.GROUP_KIND_DATA_PARALLEL: {},
            profile_pb2.GROUP_KIND_EXPERT_PARALLEL: {},
        }
        for index, cost in enumerate(profile.collectives):
            if cost.group not in by_rank:
                raise ValueError(
                    f"profile collectives[{index}]: set group to GROUP_KIND_DATA_PARALLEL or GROUP_KIND_EXPERT_PARALLEL"
                )
            try:
                link = Link(latency_us=cost.latency_us, bandwidth_bytes_per_second=cost.bandwidth_bytes_per_second)
            except ValueError as exc:
                raise ValueError(f"profile collectives[{index}]: {exc}") from None
            if cost.HasField("pipeline_rank"):
                by_rank[cost.group][cost.pipeline_rank] = link
            else:
                shared[cost.group] = link
        return cls(
            data_parallel=shared.get(profile_pb2.GROUP_KIND_DATA_PARALLEL),
            expert_parallel=shared.get(profile_pb2.GROUP_KIND_EXPERT_PARALLEL),
            data_parallel_by_rank=by_rank[profile_pb2.GROUP_KIND_DATA_PARALLEL],
            expert_parallel_by_rank=by_rank[profile_pb2.GROUP_KIND_EXPERT_PARALLEL],
        )

    def to_proto(self) -> list[profile_pb2.CollectiveCost]:
        """The ``CollectiveCost`` entries that describe these links (for a Profile's ``collectives``)."""
        out = []
        for kind, shared, by_rank in (
            (profile_pb2.GROUP_KIND_DATA_PARALLEL, self.data_parallel, self.data_parallel_by_rank),
            (profile_pb2.GROUP_KIND_EXPERT_PARALLEL, self.expert_parallel, self.expert_parallel_by_rank),
        ):
            if shared is not None:
                out.append(
                    profile_pb2.CollectiveCost(
                        group=kind,
                        latency_us=shared.latency_us,
                        bandwidth_bytes_per_second=shared.bandwidth_bytes_per_second,
                    )
                )
            for rank in sorted(by_rank):
                link = by_rank[rank]
                out.append(
                    profile_pb2.CollectiveCost(
                        group=kind,
                        pipeline_rank=rank,
                        latency_us=link.latency_us,
                        bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
                    )
                )
        return out
