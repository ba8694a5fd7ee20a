"""The tuning problem: per-layer costs, candidates (partition x placement x schedule) and their scores.

A :class:`Candidate` names contiguous layer ranges as stages (``bounds``), a
placement family (a :class:`~octopipe.tune.registry.Placement` value, which
gives every stage its rank) and a schedule: a registry entry's name or the
list scheduler with a policy. :class:`Evaluator` turns candidates into Plans and
scores them with the simulator (memory caps reported, not raised: a plan over a
cap scores by how far over it is, so a search can walk back under the caps).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from octopipe.ir import Action, Recompute, add_p2p_actions, rank_actions, validate_plan, with_recompute
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    CostModel,
    Estimate,
    Link,
    OverlapModel,
    RuntimeCosts,
    SimulationConfig,
    StageCost,
    recomputed_cost,
    simulate,
    split_layer,
    stage_cost_from_layers,
    tied_exchanges,
)
from octopipe.tune.listsched import ListSchedulerConfig, list_schedule
from octopipe.tune.registry import DEFAULT_SCHEDULES, Placement, ScheduleRegistry

__all__ = [
    "FAMILIES",
    "Candidate",
    "Evaluator",
    "Layers",
    "Score",
    "balanced_bounds",
    "equal_bounds",
    "placement_for",
    "recompute_options",
]

#: The default registry's placement families, simplest first: linear, interleaved-2, interleaved-4, v.
FAMILIES: tuple[str, ...] = DEFAULT_SCHEDULES.families


def placement_for(family: str, num_ranks: int, *, registry: ScheduleRegistry = DEFAULT_SCHEDULES) -> tuple[int, ...]:
    """Stage -> rank for a placement family of ``registry`` (e.g. ``linear``, ``interleaved-2``, ``v``)."""
    return registry.placement(family).stage_ranks(num_ranks)


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One point of the search: stage s is layers[bounds[s]:bounds[s+1]] on rank placement[s].

    ``family`` is the placement; ``schedule`` a registry entry's name or
    ``"list"`` (then ``policy`` configures the list scheduler). ``recompute``:
    each stage's recomputation policy label (``none``, ``layers``,
    ``budget:F``); empty for none on every stage.
    """

    bounds: tuple[int, ...]
    family: Placement
    schedule: str
    policy: ListSchedulerConfig | None = None
    recompute: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.num_stages % self.family.stages_per_rank == 0, (self.bounds, self.family)
        assert (self.schedule == "list") == (self.policy is not None), (self.schedule, self.policy)
        assert not self.recompute or len(self.recompute) == self.num_stages, (self.bounds, self.recompute)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def placement(self) -> tuple[int, ...]:
        """Stage -> rank."""
        return self.family.stage_ranks(self.num_stages // self.family.stages_per_rank)

    @property
    def label(self) -> str:
        """The schedule as reports name it: the entry's name, or ``list(<priority>-first, <I/W|B>, <memory>)``."""
        if self.policy is None:
            return self.schedule
        split = "I/W" if self.policy.split_backward else "B"
        memory = "reserve" if self.policy.reserve_memory else "per-stage"
        return f"list({self.policy.priority}-first, {split}, {memory})"

    def describe(self) -> str:
        sizes = [self.bounds[s + 1] - self.bounds[s] for s in range(self.num_stages)]
        return f"{self.label} on {self.family.label} placement, layers per stage {sizes}{describe_recompute(self.recompute)}"


def describe_recompute(recompute: Sequence[str]) -> str:
    """``""`` when no stage recomputes, else ``", recompute per stage [...]"``."""
    if all(label == "none" for label in recompute):
        return ""
    return f", recompute per stage [{', '.join(recompute)}]"


def recompute_options(profile: profile_pb2.Profile, wanted: Sequence[str] | None = None) -> tuple[str, ...]:
    """The recomputation policies a search may give a stage, most saved bytes first (``none`` first).

    ``wanted`` None: ``none`` and every policy the profile measured for every layer. Otherwise each
    wanted label is checked (refused, naming what the profile has, when some layer lacks it)."""
    if wanted is None:
        common = set.intersection(*({v.recompute for v in layer.recomputed} for layer in profile.layers))
        labels = ["none", *sorted(common)]
    else:
        labels = list(dict.fromkeys(Recompute.parse(label).label for label in wanted))
        if "none" not in labels:
            labels.insert(0, "none")
        for layer in profile.layers:
            for label in labels:
                recomputed_cost(layer, label)  # raises, naming the policies profiled
    saved = {
        label: sum(recomputed_cost(layer, label).activation_saved_bytes for layer in profile.layers) for label in labels
    }
    return tuple(sorted(labels, key=lambda label: (label != "none", -saved[label], label)))


@dataclass(frozen=True)
class Layers:
    """Per-layer costs from a Profile, in model order; with ``tp`` / ``cp`` > 1, as one (tensor rank,
    context rank) of a mesh runs them (``octopipe.simulate.tensor_parallel``)."""

    names: tuple[str, ...]
    costs: tuple[profile_pb2.LayerCost, ...]
    tp: int = 1
    cp: int = 1
    #: Megatron sequence parallelism over the tp ranks (mesh.sequence_parallel)
    sequence_parallel: bool = False

    @cached_property
    def shares(self) -> tuple[profile_pb2.LayerCost, ...]:
        """Each layer's per-rank share (the layers themselves at tp = cp = 1)."""
        if self.tp * self.cp == 1:
            return self.costs
        return tuple(split_layer(cost, self.tp, self.cp, self.sequence_parallel) for cost in self.costs)

    @classmethod
    def from_profile(cls, profile: profile_pb2.Profile) -> Layers:
        if not profile.layers:
            raise ValueError("the profile has no layers: profile the model first (`octopipe profile`)")
        names = tuple(layer.layer_name for layer in profile.layers)
        if len(set(names)) != len(names):
            raise ValueError("the profile names a layer twice: each LayerCost needs its own layer_name")
        return cls(names=names, costs=tuple(profile.layers))

    def __len__(self) -> int:
        return len(self.names)

    def time_us(self, index: int) -> float:
        """F + I + W of one layer for one micro-batch (one rank's share)."""
        c = self.shares[index]
        return c.forward_duration_us + c.backward_input_duration_us + c.backward_weight_duration_us

    def stage_cost(self, start: int, end: int, recompute: str = "none") -> StageCost:
        """Layers ``start:end`` as one stage with recomputation policy ``recompute``: simulate's own sum,
        so the tuner and the verifier agree."""
        costs = [recomputed_cost(cost, recompute) for cost in self.costs[start:end]]
        return stage_cost_from_layers(costs, tp=self.tp, cp=self.cp, sequence_parallel=self.sequence_parallel)


@dataclass(frozen=True, order=True)
class Score:
    """Lower is better: plans within every cap first, then by bytes over, then by step time."""

    excess_bytes: int
    step_time_us: float
    estimate: Estimate | None = field(default=None, compare=False)

    @property
    def fits(self) -> bool:
        return self.excess_bytes == 0

    @classmethod
    def infeasible(cls) -> Score:
        return cls(excess_bytes=2**62, step_time_us=math.inf)


class Evaluator:
    """Builds and scores candidates for one (profile, p, m, caps); caches the registry's orders."""

    def __init__(
        self,
        profile: profile_pb2.Profile,
        *,
        num_ranks: int,
        num_microbatches: int,
        memory_caps: Mapping[int, int],
        default_link: Link | None = None,
        overlap: OverlapModel | None = None,
        registry: ScheduleRegistry = DEFAULT_SCHEDULES,
    ) -> None:
        self.registry = registry
        self.layers = Layers.from_profile(profile)
        self.num_ranks, self.m = num_ranks, num_microbatches
        self.caps = dict(memory_caps)
        self.links = {(link.source_rank, link.destination_rank): Link.from_proto(link) for link in profile.links}
        self.default_link = default_link if default_link is not None else (None if self.links else Link())
        self.microbatch_size = max(1, profile.microbatch_size)
        # OVERLAP_F_B units cost F + B by default: overlapping hides communication, not compute
        self.overlap = overlap if overlap is not None else OverlapModel(hidden_fraction=0.0)
        self.model = profile.model
        # the runtime's own costs, as the simulator reads them from the same profile (CostModel.from_profile)
        self.runtime = RuntimeCosts.from_proto(profile.runtime) if profile.HasField("runtime") else RuntimeCosts()
        self.precision = profile.precision if profile.HasField("precision") else None
        self.tied = tuple(profile.tied_parameters)
        self.evaluations = 0
        self._library: dict[str, dict[int, list[Action]] | None] = {}

    def cost_model(self, bounds: Sequence[int], recompute: Sequence[str] = ()) -> CostModel:
        """Stage costs for ``bounds``, stage s under policy ``recompute[s]`` (empty: none everywhere)."""
        policies = recompute or ("none",) * (len(bounds) - 1)
        stages = tuple(self.layers.stage_cost(bounds[s], bounds[s + 1], policies[s]) for s in range(len(bounds) - 1))
        names = [self.layers.names[bounds[s] : bounds[s + 1]] for s in range(len(bounds) - 1)]
        return CostModel(
            stages=stages,
            tied=tied_exchanges(self.tied, names),
            links=self.links,
            default_link=self.default_link,
            overlap=self.overlap,
            microbatch_size=self.microbatch_size,
            runtime=self.runtime,
        )

    def library_order(self, name: str) -> dict[int, list[Action]] | None:
        """Registry entry ``name``'s compute order for (p, m), or None where it does not apply."""
        if name not in self._library:
            entry = self.registry.entry(name)  # an unknown name is an error, not "does not apply"
            try:
                plan = entry.generate(self.num_ranks, self.m)
            except ValueError:
                self._library[name] = None
            else:
                self._library[name] = {
                    r: [a for a in actions if a.kind.is_compute] for r, actions in rank_actions(plan).items()
                }
        return self._library[name]

    def compute(self, candidate: Candidate, model: CostModel) -> dict[int, list[Action]] | None:
        """The candidate's compute order per rank, or None where its schedule does not apply."""
        if candidate.schedule != "list":
            return self.library_order(candidate.schedule)
        assert candidate.policy is not None
        try:
            return list_schedule(model, candidate.placement, self.m, memory_caps=self.caps, config=candidate.policy)
        except ValueError:  # a cap cannot hold one micro-batch of some rank
            return None

    def plan(self, candidate: Candidate, *, name: str = "tuned", validate: bool = False) -> plan_pb2.Plan | None:
        """The candidate's Plan (p2p lowered, caps set), or None where its schedule does not apply."""
        model = self.cost_model(candidate.bounds, candidate.recompute)
        compute = self.compute(candidate, model)
        if compute is None:
            return None
        return self.assemble(candidate, compute, name=name, validate=validate)

    def assemble(
        self, candidate: Candidate, compute: Mapping[int, Sequence[Action]], *, name: str, validate: bool
    ) -> plan_pb2.Plan:
        placement = dict(enumerate(candidate.placement))
        lowered = add_p2p_actions(compute, placement)
        plan = plan_pb2.Plan(name=name, num_microbatches=self.m)
        plan.model.CopyFrom(self.model)
        if self.precision is not None:  # the dtypes the costs were measured in are the ones the plan runs
            plan.precision.CopyFrom(self.precision)
        for s, rank in enumerate(candidate.placement):
            names = self.layers.names[candidate.bounds[s] : candidate.bounds[s + 1]]
            plan.stages.add(stage_index=s, rank=rank, layer_names=names)
        for rank in range(self.num_ranks):
            program = plan.ranks.add(rank=rank)
            if rank in self.caps:
                program.memory_cap_bytes = self.caps[rank]
            add = program.actions.add
            for action in lowered.get(rank, ()):
                if action.sub_actions:
                    message = add(kind=action.kind.proto)
                    for part in action.sub_actions:
                        message.sub_actions.add(
                            kind=part.kind.proto, stage_index=part.stage, microbatch_index=part.microbatch
                        )
                elif action.microbatch is None:
                    add(kind=action.kind.proto, stage_index=action.stage)
                else:
                    add(kind=action.kind.proto, stage_index=action.stage, microbatch_index=action.microbatch)
        plan.labels["schedule"] = candidate.schedule
        plan.labels["placement"] = candidate.family.label
        plan.labels["tuned_by"] = "octopipe.tune"
        if any(label != "none" for label in candidate.recompute):
            plan = with_recompute(plan, {s: Recompute.parse(label) for s, label in enumerate(candidate.recompute)})
        if validate:
            validate_plan(plan)
        return plan

    def score(self, candidate: Candidate) -> Score:
        """Simulate the candidate (no critical path); infeasible if its schedule does not apply."""
        model = self.cost_model(candidate.bounds, candidate.recompute)
        compute = self.compute(candidate, model)
        if compute is None:
            return Score.infeasible()
        plan = self.assemble(candidate, compute, name="candidate", validate=False)
        return self.score_plan(plan, model)

    def score_plan(self, plan: plan_pb2.Plan, model: CostModel) -> Score:
        self.evaluations += 1
        config = SimulationConfig(enforce_memory_caps=False, critical_path=False)
        estimate = simulate(plan, model, config=config).estimate
        excess = sum(
            max(0, rank.peak_memory_bytes - rank.memory_cap_bytes)
            for rank in estimate.ranks
            if rank.memory_cap_bytes is not None
        )
        return Score(excess_bytes=excess, step_time_us=estimate.step_time_us, estimate=estimate)


def equal_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts per stage (the first ``num_layers % num_stages`` stages get one more)."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages need at least as many layers, the profile has {num_layers}")
    size, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return tuple(bounds)


def balanced_bounds(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous stages minimising the heaviest stage's total weight (bisection + greedy fill)."""
    n = len(weights)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least as many layers, got {n}")

    def fill(limit: float) -> tuple[int, ...] | None:
        bounds, total = [0], 0.0
        for i, weight in enumerate(weights):
            stages_left = num_stages - len(bounds) + 1
            if (total + weight > limit and i > bounds[-1]) or n - i < stages_left:
                bounds.append(i)
                total = 0.0
                if len(bounds) > num_stages:
                    return None
            total += weight
        if total > limit:
            return None
        bounds.extend([n] * (num_stages + 1 - len(bounds)))
        return tuple(bounds) if all(b < c for b, c in itertools.pairwise(bounds)) else None

    low, high = max(weights), sum(weights)
    best = fill(high) or equal_bounds(n, num_stages)
    for _ in range(60):
        middle = (low + high) / 2
        found = fill(middle)
        if found is None:
            low = middle
        else:
            best, high = found, middle
    return best
