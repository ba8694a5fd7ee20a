"""Costs of a run on local ranks (processes on one machine talking gloo over 127.0.0.1).

One definition of the local link, shared by the tuner's callers, the closed
loop and the runtime's predictions, so a plan is tuned, checked and predicted
on the same link.
"""

from __future__ import annotations

from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.costs import CostModel, Link, OverlapModel

__all__ = ["LOCAL_GLOO_LINK", "local_cost_model", "local_link"]

#: gloo between two processes on 127.0.0.1 (shared/facts.md: ~0.1 ms for 4 B, ~3-4 GB/s), used when a
#: profile measured no link
LOCAL_GLOO_LINK = Link(latency_us=100.0, bandwidth_bytes_per_second=3.5e9)


def local_link(profile: profile_pb2.Profile) -> Link:
    """The link between any two local ranks: the profile's first measured one (all local pairs are
    alike), else ``LOCAL_GLOO_LINK``. The tuner's callers (``pipeline.tune_reference``, ``octopipe tune``)
    and ``local_cost_model`` both take it from here, so a tuned plan is checked on the link it was tuned for."""
    if not profile.links:
        return LOCAL_GLOO_LINK
    return Link.from_proto(profile.links[0])


def local_cost_model(plan: plan_pb2.Plan, profile: profile_pb2.Profile) -> CostModel:
    """The simulator's costs for a run on local ranks: the profile's layers; ``local_link(profile)``
    for every pair the profile has no link for. An OVERLAP_F_B unit costs F + B: a CPU rank computes
    both halves on its one thread (overlap hides communication only)."""
    return CostModel.from_profile(
        plan, profile, default_link=local_link(profile), overlap=OverlapModel(hidden_fraction=0.0)
    )
