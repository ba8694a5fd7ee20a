"""The co-optimizer's search for one placement family at a time: the schedule phase and the partition phase.

:class:`Search` holds what one ``tune`` call has spent (simulations, seconds)
and what each phase gained (:class:`PhaseReport`). The schedule phase tries,
for fixed stage bounds, every registry schedule of the family and the list
scheduler under several policies; the partition phase (:meth:`Search.descend`)
moves one boundary layer at a time with an action order fixed, which
``tune_mesh`` also uses to refine its winner; the recomputation phase
(:meth:`Search.recompute`) moves one stage's policy one step along the
options (most saved bytes first) at a time, the same way.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from octopipe.plan.v1 import plan_pb2
from octopipe.tune.listsched import ListSchedulerConfig
from octopipe.tune.problem import Candidate, Evaluator, Score, balanced_bounds, equal_bounds
from octopipe.tune.registry import Placement

__all__ = ["PhaseReport", "Progress", "ScheduleChoice", "Search"]

_PRIORITIES: tuple[Literal["backward", "forward"], ...] = ("backward", "forward")
_POLICIES = tuple(
    ListSchedulerConfig(priority=priority, reserve_memory=reserve)
    for priority in _PRIORITIES
    for reserve in (True, False)
)
_MOVES = 8  # boundary moves simulated per sweep beyond the bottleneck rank's own

#: ``progress(message, evaluations, best_step_us)``
Progress = Callable[[str, int, float], None]


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


@dataclass(frozen=True)
class ScheduleChoice:
    """A fixed action order (the plan skeleton) and its score on some partition.

    ``schedule`` is the registry entry's name or ``"list"``; ``name`` how reports call it (``Candidate.label``);
    ``recompute`` the per-stage recomputation policies it was scored with (empty: none).
    """

    name: str
    schedule: str
    skeleton: plan_pb2.Plan
    score: Score
    policy: ListSchedulerConfig | None
    recompute: tuple[str, ...] = ()


class Search:
    """One search's state over an :class:`Evaluator` (its registry, ranks, micro-batches and caps).

    ``list_scheduler``: also try the list scheduler in the schedule phase.
    ``kicks``: random (``seed``) restarts of the partition per refined family.
    ``recompute``: the policies a stage may take, most saved bytes first
    (``octopipe.tune.recompute_options``); ``("none",)`` searches none.
    It stops after ``max_evaluations`` simulations or ``time_budget_s`` seconds
    (``stopped`` says which).
    """

    def __init__(
        self,
        evaluator: Evaluator,
        *,
        list_scheduler: bool = True,
        kicks: int = 1,
        seed: int = 0,
        max_evaluations: int = 3000,
        time_budget_s: float = 30.0,
        progress: Progress | None = None,
        recompute: tuple[str, ...] = ("none",),
    ) -> None:
        self.ev, self.progress = evaluator, progress
        self.options = recompute
        self.list_scheduler, self.kicks = list_scheduler, kicks
        self.max_evaluations, self.time_budget_s = max_evaluations, time_budget_s
        self.start = time.perf_counter()
        self.rng = random.Random(seed)
        self.phases: list[PhaseReport] = []
        self.stopped = "fixed point"
        self.placement: tuple[int, ...] = ()
        self.library: dict[str, plan_pb2.Plan] = {}
        self.prefix = list(
            itertools.accumulate((evaluator.layers.time_us(i) for i in range(len(evaluator.layers))), initial=0.0)
        )

    def out_of_budget(self) -> bool:
        if self.ev.evaluations >= self.max_evaluations:
            self.stopped = "evaluation budget"
            return True
        if time.perf_counter() - self.start > self.time_budget_s:
            self.stopped = "time budget"
            return True
        return False

    def report(self, message: str, best: Score) -> None:
        if self.progress is not None:
            self.progress(message, self.ev.evaluations, best.step_time_us)

    def score(self, skeleton: plan_pb2.Plan, bounds: Sequence[int], recompute: Sequence[str] = ()) -> Score:
        """The fixed order ``skeleton`` on stage ``bounds``, stage s under policy ``recompute[s]``."""
        return self.ev.score_plan(skeleton, self.ev.cost_model(bounds, recompute))

    # -- phase c: the schedule for fixed bounds -----------------------------------------------------------------
    def policies(self, family: Placement) -> list[ListSchedulerConfig]:
        if not self.list_scheduler:
            return []
        policies = list(_POLICIES)
        if family.kind == "linear":  # also 1F1B's warm-up depth: rank r runs at most p-r forwards ahead of its I's
            ahead = [self.ev.num_ranks - r for r in range(self.ev.num_ranks)]
            policies += [replace(policy, max_ahead=ahead) for policy in _POLICIES if policy.reserve_memory]
        return policies

    def schedules(
        self,
        family: Placement,
        bounds: tuple[int, ...],
        policies: Sequence[ListSchedulerConfig],
        recompute: tuple[str, ...] = (),
    ) -> ScheduleChoice | None:
        """The best of the family's registry schedules and the list scheduler under ``policies``
        (stages under ``recompute``)."""
        best: ScheduleChoice | None = None
        entries = self.ev.registry.in_family(family.label)
        options: list[tuple[str, ListSchedulerConfig | None]] = [(entry.name, None) for entry in entries]
        options += [("list", policy) for policy in policies]
        for name, policy in options:
            if self.out_of_budget():
                break
            candidate = Candidate(bounds=bounds, family=family, schedule=name, policy=policy, recompute=recompute)
            found = self.build(candidate)
            if found is not None and (best is None or found.score < best.score):
                best = found
        return best

    def build(self, candidate: Candidate) -> ScheduleChoice | None:
        """The candidate's order and score (a list schedule over a cap retried once with margins)."""
        model = self.ev.cost_model(candidate.bounds, candidate.recompute)
        key = candidate.schedule
        if candidate.policy is None and key in self.library:
            skeleton = self.library[key]
        else:
            compute = self.ev.compute(candidate, model)
            if compute is None:
                return None
            skeleton = self.ev.assemble(candidate, compute, name="candidate", validate=False)
            if candidate.policy is None:
                self.library[key] = skeleton
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
        return ScheduleChoice(
            name=candidate.label,
            schedule=candidate.schedule,
            skeleton=skeleton,
            score=score,
            policy=policy,
            recompute=candidate.recompute,
        )

    # -- phase a: the partition for a fixed order --------------------------------------------------------------
    def descend(
        self, skeleton: plan_pb2.Plan, bounds: tuple[int, ...], score: Score, recompute: tuple[str, ...] = ()
    ) -> tuple[tuple[int, ...], Score]:
        """Partition phase: with ``skeleton``'s order fixed (on ``self.placement``), take the first better
        one-layer boundary move, the bottleneck rank's first, until none gains or the budget is spent."""
        while not self.out_of_budget():
            found = self.first_better(skeleton, self.moves(bounds, score, bottleneck=True), score, recompute)
            if found is None:
                found = self.first_better(skeleton, self.moves(bounds, score, bottleneck=False), score, recompute)
            if found is None:
                break
            bounds, score = found
        return bounds, score

    # -- phase b: each stage's recomputation policy for a fixed order and partition ----------------------------
    def recompute(
        self, skeleton: plan_pb2.Plan, bounds: tuple[int, ...], score: Score, recompute: tuple[str, ...]
    ) -> tuple[tuple[str, ...], Score]:
        """With order and partition fixed, take the first better move of one stage's policy one step along
        ``self.options`` (over a cap: more recomputation on the ranks over it first; within every cap: less,
        on the busiest rank first), until none gains or the budget is spent."""
        if len(self.options) < 2:
            return recompute, score
        while not self.out_of_budget():
            found = None
            for moved in self.policy_moves(recompute, score):
                if self.out_of_budget():
                    break
                tried = self.score(skeleton, bounds, moved)
                if tried < score:
                    found = moved, tried
                    break
            if found is None:
                break
            recompute, score = found
        return recompute, score

    def policy_moves(self, recompute: tuple[str, ...], score: Score) -> list[tuple[str, ...]]:
        """One-step policy moves of one stage that can gain: over a cap, one more step of recomputation on a
        stage of a rank over it; within every cap, one less on any stage; the busiest rank's first."""
        current = recompute or ("none",) * len(self.placement)
        ranks = score.estimate.ranks if score.estimate is not None else ()
        over = {r.rank for r in ranks if r.memory_cap_bytes is not None and r.peak_memory_bytes > r.memory_cap_bytes}
        busy = {r.rank: r.busy_us for r in ranks}
        step = 1 if over else -1
        moves: list[tuple[float, tuple[str, ...]]] = []
        for s, label in enumerate(current):
            at = self.options.index(label) + step
            if not 0 <= at < len(self.options) or (over and self.placement[s] not in over):
                continue
            moved = list(current)
            moved[s] = self.options[at]
            moves.append((-busy.get(self.placement[s], 0.0), tuple(moved)))
        moves.sort(key=lambda item: item[0])
        return [tuple(moved) if any(x != "none" for x in moved) else () for _, moved in moves]

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
        loads = [0.0] * self.ev.num_ranks
        for s, rank in enumerate(self.placement):
            loads[rank] += self.prefix[bounds[s + 1]] - self.prefix[bounds[s]]
        mean = sum(loads) / len(loads)
        return max(loads), sum(abs(load - mean) for load in loads)

    def first_better(
        self, skeleton: plan_pb2.Plan, moves: list[tuple[int, ...]], score: Score, recompute: tuple[str, ...] = ()
    ) -> tuple[tuple[int, ...], Score] | None:
        for bounds in moves:
            if self.out_of_budget():
                break
            found = self.score(skeleton, bounds, recompute)
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
    def initial(self, family: Placement, baseline: Score) -> tuple[ScheduleChoice, tuple[int, ...]] | None:
        """Phase c on the balanced and the equal partition, every stage under each recomputation option
        (the equal partition with none only): the family's starting point."""
        p, n = self.ev.num_ranks, len(self.ev.layers)
        self.placement = family.stage_ranks(p)
        num_stages = len(self.placement)
        if num_stages > n:
            return None
        weights = [self.ev.layers.time_us(i) for i in range(n)]
        found: tuple[ScheduleChoice, tuple[int, ...]] | None = None
        balanced = balanced_bounds(weights, num_stages)
        starts = [(balanced, (option,) * num_stages if option != "none" else ()) for option in self.options]
        if equal_bounds(n, num_stages) != balanced:
            starts.insert(1, (equal_bounds(n, num_stages), ()))
        for bounds, recompute in starts:
            chosen = self.schedules(family, bounds, self.policies(family) if bounds == balanced else (), recompute)
            if chosen is not None and (found is None or chosen.score < found[0].score):
                found = (chosen, bounds)
        if found is not None:
            self.record(family.label, "schedule (initial partition)", baseline, found[0].score, found[0].name)
            self.report(f"{family.label}: {found[0].name}", found[0].score)
        return found

    def refine(
        self, family: Placement, start: ScheduleChoice, bounds: tuple[int, ...]
    ) -> tuple[ScheduleChoice, tuple[int, ...]]:
        """Alternate phases a and c from ``start`` to a fixed point, then from random kicks of the partition."""
        self.placement = family.stage_ranks(self.ev.num_ranks)
        best = start
        for attempt in range(self.kicks + 1):
            here, here_bounds = best, bounds
            if attempt:
                here_bounds = self.kick(bounds)
                here = replace(here, score=self.score(here.skeleton, here_bounds, here.recompute))
            while not self.out_of_budget():  # alternate partition, recomputation and schedule until none gains
                before = here.score
                here_bounds, moved = self.descend(here.skeleton, here_bounds, here.score, here.recompute)
                here = replace(here, score=moved)
                if not attempt:
                    self.record(family.label, "partition", before, moved)
                recompute, recomputed = self.recompute(here.skeleton, here_bounds, here.score, here.recompute)
                if recomputed < here.score:
                    if not attempt:
                        self.record(family.label, "recompute", here.score, recomputed, ", ".join(recompute))
                    here = replace(here, score=recomputed, recompute=recompute)
                policies = [here.policy] if here.policy is not None else []
                chosen = self.schedules(family, here_bounds, policies, here.recompute)
                if chosen is None or not chosen.score < here.score:
                    break
                if not attempt:
                    self.record(family.label, "schedule", here.score, chosen.score, chosen.name)
                here = chosen
            if attempt:
                self.record(family.label, f"random restart {attempt}", best.score, min(best.score, here.score))
            if here.score < best.score:
                best, bounds = here, here_bounds
            self.report(f"{family.label}: {best.name}", best.score)
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
