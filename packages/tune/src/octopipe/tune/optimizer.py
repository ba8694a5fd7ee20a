"""The co-optimizer: partition x placement x schedule, every candidate scored by the simulator.

For each placement family of the schedule registry (one stage per rank;
interleaved with 2 or 4 chunks per rank, which splits every rank's share into
finer stages; the V shape) it alternates two phases (:mod:`octopipe.tune.search`)
until neither gains (a fixed point), then kicks the partition at random (seeded)
and descends again:

* **schedule**: for the current partition, every registry schedule of the
  family and the list scheduler under each policy, built from the partition's
  costs; the best plan within the memory caps is kept as a fixed action order;
* **partition**: with that order fixed, move one boundary layer between
  neighbouring stages at a time, the bottleneck rank's boundaries first, then
  every boundary (this also swaps layers between the warm-up and cool-down
  stages), taking the best move while it shortens the simulated step;
* **recomputation** (when the profile measured recomputation policies, or
  ``TuneConfig.recompute`` names some): with order and partition fixed, move
  one stage's policy one step (more recomputation on a rank over its cap, less
  on one within it) while the score improves. Each family starts from every
  stage under each policy, so a tighter cap buys the schedule that needs more
  memory with recomputation where it costs least.

Memory caps are hard: candidates are ranked first by bytes over the caps, so
a search that starts over them walks back under, and only a plan within every
cap is returned. The search stops at a fixed point, after ``max_evaluations``
simulations or at ``time_budget_s`` (the only non-deterministic stop).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from octopipe.ir import Recompute, validate_plan, with_recompute
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate, Link, OverlapModel, SimulationConfig, simulate
from octopipe.tune.problem import (
    FAMILIES,
    Candidate,
    Evaluator,
    Layers,
    Score,
    describe_recompute,
    equal_bounds,
    recompute_options,
)
from octopipe.tune.registry import DEFAULT_SCHEDULES, Placement, ScheduleRegistry
from octopipe.tune.search import PhaseReport, Progress, ScheduleChoice, Search

__all__ = ["PhaseReport", "TuneConfig", "TuneResult", "tune"]

_REFINE_WITHIN = 1.25  # families whose initial step is further behind the best are not refined,
_REFINED = 2  # nor those after the two best


@dataclass(kw_only=True, frozen=True)
class TuneConfig:
    """What to tune for and how long.

    ``memory_cap_bytes``: the device memory budget: one cap for every rank, a
    cap per rank, or None for the peak of 1F1B on equal layer counts (the most
    any rank needs there).
    ``recompute``: the recomputation policies a stage may take (labels
    ``none``, ``layers``, ``budget:F``; each must be in the profile, see
    ``octopipe profile --recompute``). None: every policy the profile measured
    for every layer (none when it measured none); ``("none",)`` searches none.
    ``registry``: the schedules to search (``octopipe.tune.DEFAULT_SCHEDULES``;
    ``DEFAULT_SCHEDULES.with_entry(...)`` adds one).
    ``families``: placement families of ``registry`` to search (default
    ``octopipe.tune.FAMILIES``, the default registry's; ``registry.families`` for
    all of another's).
    ``kicks``: random restarts of the partition search per family (``seed``).
    ``overlap_hidden_fraction``: how much of the shorter half of an
    OVERLAP_F_B unit (DualPipeV) is hidden: 0 (the default) costs F + B,
    since overlapping hides communication, not compute; 1 is the
    simulator's optimistic default max(F, B). (Measured fused times are not
    used: a Profile's FusedCost names fixed layer lists, the tuner's stages
    change.)
    ``min_gain``: the simulator's step-time error (e.g. 0.05 for 5%). A plan
    more complex than another is chosen only when its predicted step is shorter
    by more than this fraction: starting from 1F1B on equal layers, each
    family's best in ``families`` order (give them simplest first, as
    ``FAMILIES``: linear, interleaved-2, interleaved-4, v) replaces the plan held when the held plan's step exceeds its step x
    ``1 + min_gain``; the plan held at the end is returned (never more than
    ``min_gain`` slower than the fastest). 0 returns the fastest.
    ``default_link``: the link between rank pairs the profile measured none
    for. None: the profile's own links, and a free link (no latency, no
    bandwidth limit) where it has none. Give the link the plan will be checked
    and run with, or the tuner plans for a different machine than the verifier
    checks: for local ranks that is ``octopipe.simulate.local_link(profile)``
    (the profile's link, else ``octopipe.simulate.LOCAL_GLOO_LINK``), which
    ``octopipe tune`` and ``octopipe.execute.runtime.pipeline.tune_reference`` pass.
    """

    num_ranks: int
    num_microbatches: int
    memory_cap_bytes: int | Mapping[int, int] | None = None
    families: tuple[str, ...] = FAMILIES
    list_scheduler: bool = True
    kicks: int = 1
    seed: int = 0
    overlap_hidden_fraction: float = 0.0
    max_evaluations: int = 3000
    time_budget_s: float = 30.0
    min_gain: float = 0.0
    default_link: Link | None = None
    registry: ScheduleRegistry = DEFAULT_SCHEDULES
    recompute: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        self.registry.require_baseline()
        known = self.registry.families
        unknown = [f for f in self.families if f not in known]
        if unknown or not self.families:
            raise ValueError(f"families {unknown or '()'}: choose from {', '.join(known)}")
        if not 0.0 <= self.overlap_hidden_fraction <= 1.0:
            raise ValueError(f"overlap_hidden_fraction must be in [0, 1], got {self.overlap_hidden_fraction}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain is a fraction of the step time in [0, 1), got {self.min_gain}")
        if self.kicks < 0 or self.max_evaluations < 1 or not self.time_budget_s > 0:
            raise ValueError("kicks must be >= 0, max_evaluations >= 1 and time_budget_s > 0")


@dataclass(kw_only=True, frozen=True)
class TuneResult:
    """The tuned plan (within every cap, verified), its estimate, the 1F1B baseline and the search's report."""

    plan: plan_pb2.Plan
    estimate: Estimate
    baseline: Estimate
    description: str
    memory_caps: Mapping[int, int]
    phases: tuple[PhaseReport, ...] = field(default_factory=tuple)
    best_by_family: Mapping[str, float] = field(default_factory=dict)
    evaluations: int = 0
    seconds: float = 0.0
    stopped: str = "fixed point"
    #: why this plan: the fastest, or the simplest within ``TuneConfig.min_gain`` of the fastest
    choice: str = ""
    #: the fastest plan's predicted step (the chosen one's when ``min_gain`` is 0)
    fastest_step_us: float = 0.0

    @property
    def speedup(self) -> float:
        """Baseline step time / tuned step time."""
        return self.baseline.step_time_us / self.estimate.step_time_us


def tune(
    profile: profile_pb2.Profile,
    config: TuneConfig,
    *,
    progress: Progress | None = None,
) -> TuneResult:
    """Search partition x placement x schedule for ``profile`` on ``config.num_ranks`` ranks.

    Returns the best plan found within every memory cap (verified by the
    simulator), with its estimate, the 1F1B equal-layer-count baseline and a
    report of what each phase gained. Raises ValueError when nothing fits.
    ``progress(message, evaluations, best_step_us)`` is called as it goes.
    """
    p, m = config.num_ranks, config.num_microbatches
    layers = Layers.from_profile(profile)
    if len(layers) < p:
        raise ValueError(f"{p} ranks need at least {p} layers; the profile has {len(layers)}: use fewer ranks")
    baseline_candidate = Candidate(bounds=equal_bounds(len(layers), p), family=Placement.linear(), schedule="1f1b")
    caps = _caps(profile, config, baseline_candidate)
    options = recompute_options(profile, config.recompute)
    overlap = OverlapModel(hidden_fraction=config.overlap_hidden_fraction)
    evaluator = Evaluator(
        profile,
        num_ranks=p,
        num_microbatches=m,
        memory_caps=caps,
        overlap=overlap,
        default_link=config.default_link,
        registry=config.registry,
    )
    search = Search(
        evaluator,
        list_scheduler=config.list_scheduler,
        kicks=config.kicks,
        seed=config.seed,
        max_evaluations=config.max_evaluations,
        time_budget_s=config.time_budget_s,
        progress=progress,
        recompute=options,
    )
    baseline_plan = evaluator.plan(baseline_candidate, name="1f1b-equal")
    assert baseline_plan is not None
    baseline_model = evaluator.cost_model(baseline_candidate.bounds)
    baseline = simulate(baseline_plan, baseline_model, config=SimulationConfig(enforce_memory_caps=False)).estimate
    best_score = evaluator.score_plan(baseline_plan, baseline_model)
    best = _Finalist(best_score, baseline_plan, baseline_candidate.bounds, "1f1b", "linear")
    by_family: dict[str, float] = {}
    finalists: list[_Finalist] = [best]  # simplest first
    starts: list[tuple[Score, Placement, ScheduleChoice, tuple[int, ...]]] = []
    for label in config.families:
        if search.out_of_budget():
            break
        family = config.registry.placement(label)
        found = search.initial(family, best_score)
        if found is not None:
            starts.append((found[0].score, family, *found))
    starts.sort(key=lambda item: item[0])
    for index, (score, family, schedule, bounds) in enumerate(starts):
        within = score.fits and score.step_time_us <= _REFINE_WITHIN * starts[0][0].step_time_us
        if (index and not within) or index >= _REFINED or search.out_of_budget():
            why = "out of budget" if search.out_of_budget() else f"not among the {_REFINED} best initial steps"
            search.record(family.label, "not refined", score, score, why)
        else:
            schedule, bounds = search.refine(family, schedule, bounds)
        by_family[family.label] = schedule.score.step_time_us if schedule.score.fits else float("inf")
        finalist = _Finalist(schedule.score, schedule.skeleton, bounds, schedule.name, family.label, schedule.recompute)
        finalists.append(finalist)
        if finalist.score < best.score:
            best = finalist
    simplest = finalists[0]
    finalists.sort(key=lambda item: 0 if item is simplest else 1 + config.families.index(item.family))
    fastest = best
    best, choice = _simplest_within(finalists, fastest, config.min_gain)
    score, skeleton, bounds, name, family_label, recompute = best
    if not score.fits:
        raise ValueError(_refusal(caps, finalists, options))
    plan = _finish(evaluator, skeleton, bounds, family_label, name, recompute)
    estimate = simulate(plan, evaluator.cost_model(bounds, recompute)).estimate  # verifies, enforces caps
    sizes = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    return TuneResult(
        plan=plan,
        estimate=estimate,
        baseline=baseline,
        description=f"{name} on {family_label} placement, layers per stage {sizes}{describe_recompute(recompute)}",
        memory_caps=caps,
        phases=tuple(search.phases),
        best_by_family=by_family,
        evaluations=evaluator.evaluations,
        seconds=time.perf_counter() - search.start,
        stopped=search.stopped,
        choice=choice,
        fastest_step_us=fastest[0].step_time_us,
    )


class _Finalist(NamedTuple):
    """A family's best (or the 1F1B baseline): its score, order, stage bounds, schedule label, family and
    per-stage recomputation policies (empty: none)."""

    score: Score
    skeleton: plan_pb2.Plan
    bounds: tuple[int, ...]
    name: str
    family: str
    recompute: tuple[str, ...] = ()


def _refusal(caps: Mapping[int, int], finalists: Sequence[_Finalist], options: Sequence[str]) -> str:
    """Why no plan fits: the smallest peak per rank the search reached (over every family, with every
    recomputation option searched) and the plan that reaches it."""
    reached = [(f, [r.peak_memory_bytes for r in f.score.estimate.ranks]) for f in finalists if f.score.estimate]
    if not reached:
        return f"no plan fits the memory caps {dict(caps)}: no schedule applies; raise the caps"
    smallest, peaks = min(reached, key=lambda item: (max(item[1]), item[0].score))
    searched = ", ".join(options) if len(options) > 1 else "none (the profile measured no recomputation policy)"
    return (
        f"no plan fits the memory caps {dict(caps)}: the smallest peak the search reached is {max(peaks)} bytes "
        f"on one rank (a cap of {max(peaks)} bytes per rank fits it), by {smallest.name} on "
        f"{smallest.family} placement{describe_recompute(smallest.recompute)}, whose peak per rank is {peaks} "
        f"bytes, {smallest.score.excess_bytes} bytes over the caps in all; recomputation searched: {searched}. "
        "Raise the caps, profile a recomputation policy (octopipe profile --recompute layers), use more ranks "
        "or a smaller micro-batch"
    )


def _simplest_within(finalists: Sequence[_Finalist], fastest: _Finalist, min_gain: float) -> tuple[_Finalist, str]:
    """Walk the finalists from the simplest, moving to a more complex one only when it is predicted faster
    than the one held by more than ``min_gain``; the one held at the end, and why it was chosen."""
    fast = fastest.score.step_time_us
    label = f"{fastest.name} on {fastest.family}"
    if min_gain <= 0 or not fastest.score.fits:
        return fastest, f"the fastest predicted plan ({label})"
    held = None
    for finalist in finalists:
        if finalist.score.fits and (
            held is None or held.score.step_time_us > finalist.score.step_time_us * (1 + min_gain)
        ):
            held = finalist
    if held is None:
        return fastest, f"the fastest predicted plan ({label})"
    if held.score.step_time_us == fast:
        if held is finalists[0]:
            return held, "the fastest predicted plan (1F1B with equal layer counts, the simplest)"
        return held, (
            f"the fastest predicted plan ({held.name} on {held.family}); each simpler plan is slower by more than "
            f"the {min_gain:.1%} error"
        )
    gain = held.score.step_time_us / fast - 1
    return held, (
        f"{held.name} on {held.family}: no more complex plan is faster by more than the simulator's {min_gain:.1%} "
        f"error (the fastest, {label}, is only {gain:.1%} faster predicted)"
    )


def _caps(profile: profile_pb2.Profile, config: TuneConfig, baseline: Candidate) -> dict[int, int]:
    p = config.num_ranks
    cap = config.memory_cap_bytes
    if isinstance(cap, int):
        return dict.fromkeys(range(p), cap)
    if cap is not None:
        missing = sorted(set(range(p)) - set(cap))
        if missing:
            raise ValueError(f"memory_cap_bytes has no cap for ranks {missing}: give one per rank, or one int")
        return {r: cap[r] for r in range(p)}
    evaluator = Evaluator(
        profile,
        num_ranks=p,
        num_microbatches=config.num_microbatches,
        memory_caps={},
        default_link=config.default_link,
        registry=config.registry,
    )
    plan = evaluator.plan(baseline)
    assert plan is not None
    estimate = evaluator.score_plan(plan, evaluator.cost_model(baseline.bounds)).estimate
    assert estimate is not None
    return dict.fromkeys(range(p), max(r.peak_memory_bytes for r in estimate.ranks))


def _finish(
    evaluator: Evaluator,
    skeleton: plan_pb2.Plan,
    bounds: Sequence[int],
    family: str,
    name: str,
    recompute: Sequence[str] = (),
) -> plan_pb2.Plan:
    plan = plan_pb2.Plan()
    plan.CopyFrom(skeleton)
    if any(label != "none" for label in recompute):
        plan = with_recompute(plan, {s: Recompute.parse(label) for s, label in enumerate(recompute)})
    plan.name = f"tuned-{name.split('(')[0]}-{family}-p{evaluator.num_ranks}-m{evaluator.m}"
    for s, stage in enumerate(plan.stages):
        del stage.layer_names[:]
        stage.layer_names.extend(evaluator.layers.names[bounds[s] : bounds[s + 1]])
    plan.labels["schedule"] = name
    validate_plan(plan)
    return plan
