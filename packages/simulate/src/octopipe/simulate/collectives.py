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

Which ranks a group spans (the mesh's rank order is pipeline, replica, context
rank, tensor rank, tensor innermost): a tensor-parallel group is ``tp``
consecutive ranks; a context-parallel group ``cp`` ranks ``tp`` apart, spanning
``cp * tp``; a data-parallel group ``dp`` ranks ``cp * tp`` apart, spanning
``dp * cp * tp``. A ``*_within[N]`` entry (groups inside a node of N ranks)
holds a group whose span is at most N.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.links import Link

__all__ = ["GroupLinks", "all_gather_us", "all_reduce_us", "all_to_all_us", "bucketed_us", "reduce_scatter_us"]


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


def bucketed_us(
    formula: Callable[[Link, int, int], float],
    link: Link,
    group_size: int,
    num_bytes: int,
    bucket_bytes: int | None,
) -> float:
    """``formula`` run once per bucket, one after the other: ``num_bytes`` (the whole tensor) cut into
    ``k = ceil(num_bytes / group_size / bucket_bytes)`` equal buckets of at most ``bucket_bytes`` per rank
    (None: one bucket): the same bandwidth term, ``k`` times the latency."""
    if bucket_bytes is None or num_bytes == 0:
        return formula(link, group_size, num_bytes)
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (or None for one bucket), got {bucket_bytes}")
    count = max(1, math.ceil(num_bytes / group_size / bucket_bytes))
    return count * formula(link, group_size, math.ceil(num_bytes / count))


def all_reduce_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2 * ((n-1)/n * B / bw + (n-1) * lat)."""
    return 2.0 * _ring_us(link, group_size, num_bytes)


def all_to_all_us(link: Link, group_size: int, num_bytes: int) -> float:
    """Pairwise all-to-all of ``num_bytes`` per rank: (n-1)/n * B / bw + (n-1) * lat."""
    return _ring_us(link, group_size, num_bytes)


@dataclass(kw_only=True, frozen=True)
class GroupLinks:
    """The hop cost of each kind of mesh group: data-parallel (FSDP), expert-parallel, tensor- and context-parallel.

    For a group of n ranks of pipeline rank p the link is, in order: the
    ``*_by_rank[p]`` override; else the ``*_within[N]`` entry with the smallest
    N >= n (groups of at most N ranks, e.g. ``{8: nvlink}`` for groups inside an
    8-GPU node; assumes groups of consecutive, node-aligned ranks, as the default
    rank map gives when dp divides the node size); else ``data_parallel`` /
    ``expert_parallel``. Tensor- and context-parallel groups without entries of
    their own take the data-parallel entries for their span (module doc): a tp
    group inside a node rides the node's link.
    """

    data_parallel: Link | None = None
    expert_parallel: Link | None = None
    data_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)
    expert_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)
    data_parallel_within: Mapping[int, Link] = field(default_factory=dict)
    expert_parallel_within: Mapping[int, Link] = field(default_factory=dict)
    tensor_parallel: Link | None = None
    context_parallel: Link | None = None
    tensor_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)
    context_parallel_by_rank: Mapping[int, Link] = field(default_factory=dict)
    tensor_parallel_within: Mapping[int, Link] = field(default_factory=dict)
    context_parallel_within: Mapping[int, Link] = field(default_factory=dict)

    def data_parallel_link(self, pipeline_rank: int, group_size: int | None = None) -> Link:
        """The hop cost of ``pipeline_rank``'s data-parallel group (of ``group_size`` ranks, if known)."""
        return _pick(
            self.data_parallel_by_rank, self.data_parallel_within, self.data_parallel, pipeline_rank, group_size, "DATA"
        )

    def expert_parallel_link(self, pipeline_rank: int, group_size: int | None = None) -> Link:
        """The hop cost of ``pipeline_rank``'s expert-parallel groups (of ``group_size`` ranks, if known)."""
        return _pick(
            self.expert_parallel_by_rank,
            self.expert_parallel_within,
            self.expert_parallel,
            pipeline_rank,
            group_size,
            "EXPERT",
        )

    def tensor_parallel_link(self, pipeline_rank: int, group_size: int) -> Link:
        """The hop cost of ``pipeline_rank``'s tensor-parallel groups (``group_size`` consecutive ranks)."""
        found = _find(
            self.tensor_parallel_by_rank, self.tensor_parallel_within, self.tensor_parallel, pipeline_rank, group_size
        )
        return found if found is not None else self.data_parallel_link(pipeline_rank, group_size)

    def context_parallel_link(self, pipeline_rank: int, group_size: int, span: int) -> Link:
        """The hop cost of ``pipeline_rank``'s context-parallel groups (``group_size`` ranks over ``span``)."""
        found = _find(
            self.context_parallel_by_rank, self.context_parallel_within, self.context_parallel, pipeline_rank, span
        )
        return found if found is not None else self.data_parallel_link(pipeline_rank, span)

    @classmethod
    def from_profile(cls, profile: profile_pb2.Profile) -> GroupLinks | None:
        """The profile's ``collectives`` (None when it has none)."""
        if not profile.collectives:
            return None
        kinds = (
            profile_pb2.GROUP_KIND_DATA_PARALLEL,
            profile_pb2.GROUP_KIND_EXPERT_PARALLEL,
            profile_pb2.GROUP_KIND_TENSOR_PARALLEL,
            profile_pb2.GROUP_KIND_CONTEXT_PARALLEL,
        )
        shared: dict[int, Link] = {}
        by_rank: dict[int, dict[int, Link]] = {kind: {} for kind in kinds}
        within: dict[int, dict[int, Link]] = {kind: {} for kind in kinds}
        for index, cost in enumerate(profile.collectives):
            where = f"profile collectives[{index}]"
            if cost.group not in kinds:
                raise ValueError(
                    f"{where}: set group to GROUP_KIND_DATA_PARALLEL, GROUP_KIND_EXPERT_PARALLEL, "
                    "GROUP_KIND_TENSOR_PARALLEL or GROUP_KIND_CONTEXT_PARALLEL"
                )
            try:
                link = Link.from_proto(cost)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if cost.HasField("pipeline_rank") and cost.HasField("max_group_size"):
                raise ValueError(f"{where}: give pipeline_rank or max_group_size, not both")
            if cost.HasField("pipeline_rank"):
                by_rank[cost.group][cost.pipeline_rank] = link
            elif cost.HasField("max_group_size"):
                if cost.max_group_size < 1:
                    raise ValueError(f"{where}: max_group_size must be >= 1")
                within[cost.group][cost.max_group_size] = link
            else:
                shared[cost.group] = link
        data, expert, tensor, context = kinds
        return cls(
            data_parallel=shared.get(data),
            expert_parallel=shared.get(expert),
            data_parallel_by_rank=by_rank[data],
            expert_parallel_by_rank=by_rank[expert],
            data_parallel_within=within[data],
            expert_parallel_within=within[expert],
            tensor_parallel=shared.get(tensor),
            context_parallel=shared.get(context),
            tensor_parallel_by_rank=by_rank[tensor],
            context_parallel_by_rank=by_rank[context],
            tensor_parallel_within=within[tensor],
            context_parallel_within=within[context],
        )

    def to_proto(self) -> list[profile_pb2.CollectiveCost]:
        """The ``CollectiveCost`` entries that describe these links (for a Profile's ``collectives``)."""
        out = []
        for kind, shared, by_rank, within in (
            (
                profile_pb2.GROUP_KIND_DATA_PARALLEL,
                self.data_parallel,
                self.data_parallel_by_rank,
                self.data_parallel_within,
            ),
            (
                profile_pb2.GROUP_KIND_EXPERT_PARALLEL,
                self.expert_parallel,
                self.expert_parallel_by_rank,
                self.expert_parallel_within,
            ),
            (
                profile_pb2.GROUP_KIND_TENSOR_PARALLEL,
                self.tensor_parallel,
                self.tensor_parallel_by_rank,
                self.tensor_parallel_within,
            ),
            (
                profile_pb2.GROUP_KIND_CONTEXT_PARALLEL,
                self.context_parallel,
                self.context_parallel_by_rank,
                self.context_parallel_within,
            ),
        ):
            if shared is not None:
                out.append(_entry(kind, shared))
            for rank in sorted(by_rank):
                out.append(_entry(kind, by_rank[rank], pipeline_rank=rank))
            for size in sorted(within):
                out.append(_entry(kind, within[size], max_group_size=size))
        return out


def _entry(kind: profile_pb2.GroupKind.ValueType, link: Link, **where: int) -> profile_pb2.CollectiveCost:
    return profile_pb2.CollectiveCost(
        group=kind, latency_us=link.latency_us, bandwidth_bytes_per_second=link.bandwidth_bytes_per_second, **where
    )


def _find(
    by_rank: Mapping[int, Link],
    within: Mapping[int, Link],
    shared: Link | None,
    pipeline_rank: int,
    group_size: int | None,
) -> Link | None:
    found = by_rank.get(pipeline_rank)
    if found is None and group_size is not None:
        bounds = [size for size in within if size >= group_size]
        if bounds:
            found = within[min(bounds)]
    return shared if found is None else found


def _pick(
    by_rank: Mapping[int, Link],
    within: Mapping[int, Link],
    shared: Link | None,
    pipeline_rank: int,
    group_size: int | None,
    kind: str,
) -> Link:
    found = _find(by_rank, within, shared, pipeline_rank, group_size)
    if found is None:
        name = "data-parallel" if kind == "DATA" else "expert-parallel"
        raise ValueError(
            f"no {name} collective cost for pipeline rank {pipeline_rank}"
            + (f" (a group of {group_size} ranks)" if group_size is not None else "")
            + f": add a CollectiveCost (group GROUP_KIND_{kind}_PARALLEL) to the profile, or set GroupLinks.{name.replace('-', '_')}"
        )
    return found
