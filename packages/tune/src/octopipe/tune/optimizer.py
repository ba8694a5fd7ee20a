"""The co-optimizer: partition x placement x schedule, every candidate scored by the simulator.

For each placement family (one stage per rank; interleaved with 2 or 4 chunks
per rank, which splits every rank's share into finer stages; the V shape) it
alternates two phases until neither gains (a fixed point), then kicks the
partition at random (seeded) and descends again:

* **schedule**: for the current partition, every library schedule of the
  family and the list scheduler under each policy, built from the partition's
  costs; the best plan within the memory caps is kept as a fixed action order;
* **partition**: with that order fixed, move one boundary layer between
  neighbouring stages at a time, the bottleneck rank's boundaries first, then
  every boundary (this also swaps layers between the warm-up and cool-down
  stages), taking the best move while it shortens the simulated step.

Memory caps are hard: candidates are ranked first by bytes over the caps, so
a search that starts over them walks back under, and only a plan within every
cap is returned. The search stops at a fixed point, after ``max_evaluations``
simulations or at ``time_budget_s`` (the only non-deterministic stop).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from octopipe.ir import validate_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import Estimate, Link, OverlapModel, SimulationConfig, simulate
from octopipe.tune.listsched import ListSchedulerConfig
from octopipe.tune.problem import (
    FAMILIES,
    LIBRARY,
    Candidate,
    Evaluator,
    Layers,
    Score,
    balanced_bounds,
    equal_bounds,
    placement_for,
)

__all__ = ["PhaseReport", "TuneConfig", "TuneResult", "tune"]

_PRIORITIES: tuple[Literal["backward", "forward"], ...] = ("backward", "forward")
_POLICIES = tuple(
    ListSchedulerConfig(priority=priority, reserve_memory=reserve)
    for priority in _PRIORITIES
    for reserve in (True, False)
)

Progress = Callable[[str, int, float], None]
_REFINE_WITHIN = 1.25  # families whose initial step is further behind the best are not refined,
_REFINED = 2  # nor those after the two best
_MOVES = 8  # boundary moves simulated per sweep beyond the bottleneck rank's own


@dataclass(kw_only=True, frozen=True)
class TuneConfig:
    """What to tune for and how long.

    ``memory_cap_bytes``: one cap for every rank, a cap per rank, or None for
    the peak of 1F1B on equal layer counts (the most any rank needs there).
    ``families``: placement families to search (see ``octopipe.tune.FAMILIES``).
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
    family's best in ``FAMILIES`` order (linear, interleaved-2, interleaved-4,
    v) replaces the plan held when the held plan's step exceeds its step x
    ``1 + min_gain``; the plan held at the end is returned (never more than
    ``min_gain`` slower than the fastest). 0 returns the fastest.
    ``default_link``: the link between rank pairs the profile measured none
    for. None: the profile's own links, and a free link (no latency, no
    bandwidth limit) where it has none. Give the link the plan will be checked
    and run with (``octopipe.execute`` passes its local link), or the tuner
    plans for a different machine than the verifier checks.
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

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"families {unknown or '()'}: choose from {', '.join(FAMILIES)}")
        if not 0.0 <= self.overlap_hidden_fraction <= 1.0:
            raise ValueError(f"overlap_hidden_fraction must be in [0, 1], got {self.overlap_hidden_fraction}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain is a fraction of the step time in [0, 1), got {self.min_gain}")
        if self.kicks < 0 or self.max_evaluations < 1 or not self.time_budget_s > 0:
            raise ValueError("kicks must be >= 0, max_evaluations >= 1 and time_budget_s > 0")


@dataclass(kw_only=True, frozen=True)
class PhaseReport:
    """One phase of the search: the best step time before and after it."""

    family: str
    phase: str
    before_us: float
    after_us: float
    evaluations: int
    seconds: float
    detail: str = ""

    @property
    def gain(self) -> float:
        """before / after (1.0: no gain)."""
        return self.before_us / self.after_us if self.after_us > 0 else 1.0


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


@dataclass(frozen=True)
class _Schedule:
    """A fixed action order (the plan skeleton) and its score on some partition."""

    name: str
    skeleton: plan_pb2.Plan
    score: Score
    policy: ListSchedulerConfig | None


class _Search:
    def __init__(self, evaluator: Evaluator, config: TuneConfig, progress: Progress | None) -> None:
        self.ev, self.config, self.progress = evaluator, config, progress
        self.start = time.perf_counter()
        self.rng = random.Random(config.seed)
        self.phases: list[PhaseReport] = []
        self.stopped = "fixed point"
        self.placement: tuple[int, ...] = ()
        self.library: dict[tuple[str, str], plan_pb2.Plan] = {}
        self.prefix = list(
            itertools.accumulate((evaluator.layers.time_us(i) for i in range(len(evaluator.layers))), initial=0.0)
        )

    def out_of_budget(self) -> bool:
        if self.ev.evaluations >= self.config.max_evaluations:
            self.stopped = "evaluation budget"
            return True
        if time.perf_counter() - self.start > self.config.time_budget_s:
            self.stopped = "time budget"
            return True
        return False

    def report(self, message: str, best: Score) -> None:
        if self.progress is not None:
            self.progress(message, self.ev.evaluations, best.step_time_us)

    def score(self, skeleton: plan_pb2.Plan, bounds: Sequence[int]) -> Score:
        return self.ev.score_plan(skeleton, self.ev.cost_model(bounds))

    # -- phase c: the schedule for fixed bounds -----------------------------------------------------------------
    def policies(self, family: str) -> list[ListSchedulerConfig]:
        if not self.config.list_scheduler:
            return []
        policies = list(_POLICIES)
        if family == "linear":  # also 1F1B's warm-up depth: rank r runs at most p-r forwards ahead of its I's
            ahead = [self.config.num_ranks - r for r in range(self.config.num_ranks)]
            policies += [replace(policy, max_ahead=ahead) for policy in _POLICIES if policy.reserve_memory]
        return policies

    def schedules(
        self, family: str, bounds: tuple[int, ...], policies: Sequence[ListSchedulerConfig]
    ) -> _Schedule | None:
        """The best of the family's library schedules and the list scheduler under ``policies``."""
        placement = placement_for(family, self.config.num_ranks)
        best: _Schedule | None = None
        options: list[tuple[str, ListSchedulerConfig | None]] = [(name, None) for name in LIBRARY[family]]
        options += [("list", policy) for policy in policies]
        for name, policy in options:
            if self.out_of_budget():
                break
            candidate = Candidate(bounds=bounds, family=family, placement=placement, schedule=name, policy=policy)
            found = self.build(candidate)
            if found is not None and (best is None or found.score < best.score):
                best = found
        return best

    def build(self, candidate: Candidate) -> _Schedule | None:
        model = self.ev.cost_model(candidate.bounds)
        key = (candidate.family, candidate.schedule)
        if candidate.policy is None and key in self.library:
            skeleton = self.library[key]
        else:
            compute = self.ev.compute(candidate, model)
            if compute is None:
                return None
            skeleton = self.ev.assemble(candidate, compute, name="candidate", validate=False)
            if candidate.policy is None:
                self.library[key] = skeleton
        name = candidate.describe().split(" on ")[0]
        score = self.ev.score_plan(skeleton, model)
        policy = candidate.policy
        if policy is not None and not score.fits and score.estimate is not None:
            # the list scheduler does not count p2p buffers: keep what went over free, once
            margins = [
                max(0, rank.peak_memory_bytes - (rank.memory_cap_bytes or rank.peak_memory_bytes))
                for rank in score.estimate.ranks
            ]
            retry = replace(candidate, policy=replace(policy, memory_margin_bytes=margins))
            compute = self.ev.compute(retry, model)
            if compute is not None:
                retried = self.ev.assemble(retry, compute, name="candidate", validate=False)
                retry_score = self.ev.score_plan(retried, model)
                if retry_score < score:
                    skeleton, score, policy = retried, retry_score, retry.policy
        return _Schedule(name=name, skeleton=skeleton, score=score, policy=policy)

    # -- phase a: the partition for a fixed order --------------------------------------------------------------
    def descend(self, skeleton: plan_pb2.Plan, bounds: tuple[int, ...], score: Score) -> tuple[tuple[int, ...], Score]:
        while not self.out_of_budget():
            found = self.first_better(skeleton, self.moves(bounds, score, bottleneck=True), score)
            if found is None:
                found = self.first_better(skeleton, self.moves(bounds, score, bottleneck=False), score)
            if found is None:
                break
            bounds, score = found
        return bounds, score

    def moves(self, bounds: tuple[int, ...], score: Score, *, bottleneck: bool) -> list[tuple[int, ...]]:
        """One-layer boundary moves, the most promising (by rank-load balance) first, at most ``_MOVES``."""
        num_stages = len(bounds) - 1
        boundaries: Sequence[int] = range(1, num_stages)
        if bottleneck and score.estimate is not None:
            busy = [r.busy_us for r in score.estimate.ranks]
            heaviest = max(range(len(busy)), key=lambda r: (busy[r], -r))
            stages = [s for s in range(num_stages) if self.placement[s] == heaviest]
            boundaries = sorted({b for s in stages for b in (s, s + 1) if 0 < b < num_stages})
        out = []
        for b in boundaries:
            for step in (-1, 1):
                moved = list(bounds)
                moved[b] += step
                if moved[b - 1] < moved[b] < moved[b + 1]:
                    out.append(tuple(moved))
        out.sort(key=self.imbalance)
        return out if bottleneck else out[:_MOVES]

    def imbalance(self, bounds: Sequence[int]) -> tuple[float, float]:
        """The heaviest rank's F+I+W per micro-batch, then the spread of all ranks' (a cheap proxy)."""
        loads = [0.0] * self.config.num_ranks
        for s, rank in enumerate(self.placement):
            loads[rank] += self.prefix[bounds[s + 1]] - self.prefix[bounds[s]]
        mean = sum(loads) / len(loads)
        return max(loads), sum(abs(load - mean) for load in loads)

    def first_better(
        self, skeleton: plan_pb2.Plan, moves: list[tuple[int, ...]], score: Score
    ) -> tuple[tuple[int, ...], Score] | None:
        for bounds in moves:
            if self.out_of_budget():
                break
            found = self.score(skeleton, bounds)
            if found < score:
                return bounds, found
        return None

    def kick(self, bounds: tuple[int, ...]) -> tuple[int, ...]:
        moved = list(bounds)
        if len(bounds) < 3:  # one stage: nothing to move
            return bounds
        for _ in range(max(1, (len(bounds) - 1) // 4)):
            b = self.rng.randrange(1, len(bounds) - 1)
            moved[b] = min(max(moved[b] + self.rng.choice((-2, -1, 1, 2)), moved[b - 1] + 1), moved[b + 1] - 1)
        return tuple(moved)

    # -- one family --------------------------------------------------------------------------------------------
    def initial(self, family: str, baseline: Score) -> tuple[_Schedule, tuple[int, ...]] | None:
        """Phase c on the balanced and the equal partition: the family's starting point."""
        p, n = self.config.num_ranks, len(self.ev.layers)
        self.placement = placement_for(family, p)
        num_stages = len(self.placement)
        if num_stages > n:
            return None
        weights = [self.ev.layers.time_us(i) for i in range(n)]
        found: tuple[_Schedule, tuple[int, ...]] | None = None
        balanced = balanced_bounds(weights, num_stages)
        for bounds in dict.fromkeys([balanced, equal_bounds(n, num_stages)]):
            chosen = self.schedules(family, bounds, self.policies(family) if bounds == balanced else ())
            if chosen is not None and (found is None or chosen.score < found[0].score):
                found = (chosen, bounds)
        if found is not None:
            self.record(family, "schedule (initial partition)", baseline, found[0].score, found[0].name)
            self.report(f"{family}: {found[0].name}", found[0].score)
        return found

    def refine(self, family: str, start: _Schedule, bounds: tuple[int, ...]) -> tuple[_Schedule, tuple[int, ...]]:
        """Alternate phases a and c from ``start`` to a fixed point, then from random kicks of the partition."""
        self.placement = placement_for(family, self.config.num_ranks)
        best = start
        for attempt in range(self.config.kicks + 1):
            here, here_bounds = best, bounds
            if attempt:
                here_bounds = self.kick(bounds)
                here = replace(here, score=self.score(here.skeleton, here_bounds))
            while not self.out_of_budget():  # alternate partition and schedule until neither gains
                before = here.score
                here_bounds, moved = self.descend(here.skeleton, here_bounds, here.score)
                here = replace(here, score=moved)
                if not attempt:
                    self.record(family, "partition", before, moved)
                policies = [here.policy] if here.policy is not None else []
                chosen = self.schedules(family, here_bounds, policies)
                if chosen is None or not chosen.score < here.score:
                    break
                if not attempt:
                    self.record(family, "schedule", here.score, chosen.score, chosen.name)
                here = chosen
            if attempt:
                self.record(family, f"random restart {attempt}", best.score, min(best.score, here.score))
            if here.score < best.score:
                best, bounds = here, here_bounds
            self.report(f"{family}: {best.name}", best.score)
            if self.out_of_budget():
                break
        return best, bounds

    def record(self, family: str, phase: str, before: Score, after: Score, detail: str = "") -> None:
        self.phases.append(
            PhaseReport(
                family=family,
                phase=phase,
                before_us=before.step_time_us,
                after_us=after.step_time_us,
                evaluations=self.ev.evaluations,
                seconds=time.perf_counter() - self.start,
                detail=detail,
            )
        )


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
    baseline_candidate = Candidate(
        bounds=equal_bounds(len(layers), p), family="linear", placement=placement_for("linear", p), schedule="1f1b"
    )
    caps = _caps(profile, config, baseline_candidate)
    overlap = OverlapModel(hidden_fraction=config.overlap_hidden_fraction)
    evaluator = Evaluator(
        profile, num_ranks=p, num_microbatches=m, memory_caps=caps, overlap=overlap, default_link=config.default_link
    )
    search = _Search(evaluator, config, progress)
    baseline_plan = evaluator.plan(baseline_candidate, name="1f1b-equal")
    assert baseline_plan is not None
    baseline_model = evaluator.cost_model(baseline_candidate.bounds)
    baseline = simulate(baseline_plan, baseline_model, config=SimulationConfig(enforce_memory_caps=False)).estimate
    best_score = evaluator.score_plan(baseline_plan, baseline_model)
    best: tuple[Score, plan_pb2.Plan, tuple[int, ...], str, str] = (
        best_score,
        baseline_plan,
        baseline_candidate.bounds,
        "1f1b",
        "linear",
    )
    by_family: dict[str, float] = {}
    finalists: list[tuple[Score, plan_pb2.Plan, tuple[int, ...], str, str]] = [best]  # simplest first
    starts: list[tuple[Score, str, _Schedule, tuple[int, ...]]] = []
    for family in config.families:
        if search.out_of_budget():
            break
        found = search.initial(family, best_score)
        if found is not None:
            starts.append((found[0].score, family, *found))
    starts.sort(key=lambda item: item[0])
    for index, (score, family, schedule, bounds) in enumerate(starts):
        within = score.fits and score.step_time_us <= _REFINE_WITHIN * starts[0][0].step_time_us
        if (index and not within) or index >= _REFINED or search.out_of_budget():
            why = "out of budget" if search.out_of_budget() else f"not among the {_REFINED} best initial steps"
            search.record(family, "not refined", score, score, why)
        else:
            schedule, bounds = search.refine(family, schedule, bounds)
        by_family[family] = schedule.score.step_time_us if schedule.score.fits else float("inf")
        finalists.append((schedule.score, schedule.skeleton, bounds, schedule.name, family))
        if schedule.score < best[0]:
            best = (schedule.score, schedule.skeleton, bounds, schedule.name, family)
    simplest = finalists[0]
    finalists.sort(key=lambda item: 0 if item is simplest else 1 + config.families.index(item[4]))
    fastest = best
    best, choice = _simplest_within(finalists, fastest, config.min_gain)
    score, skeleton, bounds, name, family = best
    if not score.fits:
        raise ValueError(
            f"no plan fits the memory caps {dict(caps)} (closest: {score.excess_bytes} bytes over): "
            "raise the caps, use fewer micro-batches in flight (more ranks) or a smaller micro-batch"
        )
    plan = _finish(evaluator, skeleton, bounds, family, name)
    estimate = simulate(plan, evaluator.cost_model(bounds)).estimate  # verifies, enforces caps
    sizes = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    return TuneResult(
        plan=plan,
        estimate=estimate,
        baseline=baseline,
        description=f"{name} on {family} placement, layers per stage {sizes}",
        memory_caps=caps,
        phases=tuple(search.phases),
        best_by_family=by_family,
        evaluations=evaluator.evaluations,
        seconds=time.perf_counter() - search.start,
        stopped=search.stopped,
        choice=choice,
        fastest_step_us=fastest[0].step_time_us,
    )


def _simplest_within(
    finalists: Sequence[tuple[Score, plan_pb2.Plan, tuple[int, ...], str, str]],
    fastest: tuple[Score, plan_pb2.Plan, tuple[int, ...], str, str],
    min_gain: float,
) -> tuple[tuple[Score, plan_pb2.Plan, tuple[int, ...], str, str], str]:
    """Walk the finalists from the simplest, moving to a more complex one only when it is predicted faster
    than the one held by more than ``min_gain``; the one held at the end, and why it was chosen."""
    fast = fastest[0].step_time_us
    label = f"{fastest[3]} on {fastest[4]}"
    if min_gain <= 0 or not fastest[0].fits:
        return fastest, f"the fastest predicted plan ({label})"
    held = None
    for finalist in finalists:
        if finalist[0].fits and (held is None or held[0].step_time_us > finalist[0].step_time_us * (1 + min_gain)):
            held = finalist
    if held is None:
        return fastest, f"the fastest predicted plan ({label})"
    if held[0].step_time_us == fast:
        if held is finalists[0]:
            return held, "the fastest predicted plan (1F1B with equal layer counts, the simplest)"
        return held, (
            f"the fastest predicted plan ({held[3]} on {held[4]}); each simpler plan is slower by more than "
            f"the {min_gain:.1%} error"
        )
    gain = held[0].step_time_us / fast - 1
    return held, (
        f"{held[3]} on {held[4]}: no more complex plan is faster by more than the simulator's {min_gain:.1%} "
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
        profile, num_ranks=p, num_microbatches=config.num_microbatches, memory_caps={}, default_link=config.default_link
    )
    plan = evaluator.plan(baseline)
    assert plan is not None
    estimate = evaluator.score_plan(plan, evaluator.cost_model(baseline.bounds)).estimate
    assert estimate is not None
    return dict.fromkeys(range(p), max(r.peak_memory_bytes for r in estimate.ranks))


def _finish(
    evaluator: Evaluator, skeleton: plan_pb2.Plan, bounds: Sequence[int], family: str, name: str
) -> plan_pb2.Plan:
    plan = plan_pb2.Plan()
    plan.CopyFrom(skeleton)
    plan.name = f"tuned-{name.split('(')[0]}-{family}-p{evaluator.num_ranks}-m{evaluator.m}"
    for s, stage in enumerate(plan.stages):
        del stage.layer_names[:]
        stage.layer_names.extend(evaluator.layers.names[bounds[s] : bounds[s + 1]])
    plan.labels["schedule"] = name
    validate_plan(plan)
    return plan
