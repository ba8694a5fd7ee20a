"""torch.distributed.pipelining interop: torch's schedules as Plans, Plans as torch's CSV.

``torch_schedule_plan`` asks torch's own schedule classes for their action
order (they read only stage indices and sizes, so stand-in stages suffice and no
process group is formed), turns each cell of it into an octopipe Action, adds
the point-to-point actions and places the stages as torch does. Which classes
are known and where their stages go (one stage per rank; interleaved: stage s
on rank s % p; V-shaped: stages s and 2p-1-s on rank s) is the schedule
registry's (``octopipe.tune.DEFAULT_SCHEDULES``: each entry's ``torch_class``
and ``placement``). The reverse, a Plan as torch CSV, is
``octopipe.ir.plan_to_torch_csv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from octopipe.ir import Action, StageSpec, add_p2p_actions, build_plan, parse_action
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import DEFAULT_SCHEDULES, ScheduleRegistry

__all__ = ["torch_placement", "torch_schedule_plan", "torch_schedules"]


class _StandIn:
    """What torch's schedule classes read from a stage to compute their order."""

    def __init__(self, index: int, num_stages: int, rank: int, size: int) -> None:
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, size
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def torch_schedules(registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> dict[str, int]:
    """torch schedule class -> stages per rank, for every class ``registry`` has an entry for."""
    return {cls: registry.by_torch_class(cls).placement.stages_per_rank for cls in registry.torch_classes}


def torch_placement(name: str, num_ranks: int, *, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> dict[int, int]:
    """stage -> rank as torch places it for schedule class ``name`` (ValueError for a class without an entry)."""
    return dict(enumerate(registry.by_torch_class(name).placement.stage_ranks(num_ranks)))


def torch_schedule_plan(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    layer_names: Sequence[Sequence[str]] | None = None,
    model: plan_pb2.ModelReference | None = None,
    registry: ScheduleRegistry = DEFAULT_SCHEDULES,
) -> plan_pb2.Plan:
    """The Plan of torch's schedule class ``name`` (compute order from torch, p2p lowered here)."""
    placement = torch_placement(name, num_ranks, registry=registry)  # ValueError naming the classes
    from torch.distributed.pipelining import schedules  # noqa: PLC0415

    num_stages = len(placement)
    if layer_names is not None and len(layer_names) != num_stages:
        raise ValueError(f"{name} on {num_ranks} ranks has {num_stages} stages; layer_names has {len(layer_names)}")
    cls: Any = getattr(schedules, name)
    mine = [_StandIn(s, num_stages, 0, num_ranks) for s in sorted(s for s, r in placement.items() if r == 0)]
    schedule = (
        cls(mine, num_microbatches)
        if issubclass(cls, schedules.PipelineScheduleMulti)
        else cls(mine[0], num_microbatches)
    )
    order: dict[int, list[Action]] = {
        rank: [parse_action(str(a)) for a in actions if a is not None]
        for rank, actions in schedule.pipeline_order.items()
    }
    stages = [
        StageSpec(rank=placement[s], layer_names=tuple(layer_names[s]) if layer_names else ())
        for s in range(num_stages)
    ]
    return build_plan(
        stages=stages,
        actions=add_p2p_actions(order, placement),
        num_microbatches=num_microbatches,
        name=f"torch-{name}-p{num_ranks}-m{num_microbatches}",
        model=model,
        labels={"schedule": name, "source": "torch.distributed.pipelining"},
    )
