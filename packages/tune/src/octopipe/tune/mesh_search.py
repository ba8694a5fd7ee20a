"""Choosing the mesh: pp x dp (and so the micro-batch count) for a number of devices, with FSDP collectives.

Given D devices, a global batch of G samples and a Profile whose micro-batches
hold b samples, every pipeline degree pp that divides D (and has at least one
layer per stage) gives dp = D / pp data-parallel replicas, each with G / dp
samples per step (pp is skipped where that is not a multiple of b). The
micro-batch count m is the largest count of at most ``max_microbatches`` that
splits them into equal micro-batches of k x b samples (k >= 1); the profile's
per-micro-batch costs are then scaled by k (times, activation, boundary and
all-to-all bytes; not parameters): linear in the micro-batch size, which holds
for micro-batches big enough to keep a device busy, and makes more, smaller
micro-batches never slower, so the cap on m only bounds the search's cost.
For each (pp, dp, m) the search

1. partitions the layers into stages balanced by F + I + W time,
2. takes every registry schedule of the chosen placement families (see
   ``octopipe.tune.DEFAULT_SCHEDULES``) and places UNSHARD / RESHARD / REDUCE_GRAD under
   each :data:`~octopipe.ir.fsdp.PLACEMENTS` policy,
3. simulates ONE pipeline replica (all replicas are identical: the simulator
   times the collectives by the group size dp and counts the sharded bytes),

and keeps the fastest plan within the memory cap. The winner's partition is
then refined for ``refine_s`` seconds by the co-optimizer's boundary moves with
its action order fixed. The baseline is 1F1B with equal layer counts on the
same mesh (same pp, dp, m; collectives prefetched, no RESHARD). Plans are
scored by step time: every candidate processes the same global batch, so the
shortest step is the highest throughput.

Expert parallelism: with ``ep=None`` (the default) and a Profile with MoE
layers (``LayerCost.num_experts``), every ep that divides both dp and each MoE
layer's expert count is tried for each (pp, dp, m): a larger ep holds fewer
experts per device (less memory) and sends its all-to-alls over a larger
group. Without MoE layers ep is 1; a given ``ep`` is used as it is.

Tensor and context parallelism (``tensor_parallel=True``, the default, and
``model_facts`` or ``tp_degrees`` / ``cp_degrees`` given): each (tp, cp) pair of
``octopipe.tune.mesh_parallel.parallel_degrees`` splits every stage replica
over tp x cp devices, so pp x dp = D / (tp x cp); the simulator times each
rank's share and its TP/CP collectives (``octopipe.simulate.tensor_parallel``).
(tp, cp) = (1, 1) is searched first exactly as without it; other meshes in the
order of a lower bound on their step, skipped once it cannot beat the best
plan within the cap. ``tensor_parallel=False`` searches pp x dp only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from octopipe.ir import validate_plan
from octopipe.ir.fsdp import PLACEMENTS, CollectivePlacement, place_collectives
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Estimate, GroupLinks, Link, OverlapModel, SimulationConfig, simulate
from octopipe.tune.mesh_parallel import parallel_degrees, scale_microbatches, step_lower_bound_us
from octopipe.tune.problem import FAMILIES, Candidate, Evaluator, Layers, Score, balanced_bounds, equal_bounds
from octopipe.tune.registry import DEFAULT_SCHEDULES, Placement, ScheduleRegistry
from octopipe.tune.search import Search

__all__ = ["MeshCandidate", "MeshTuneConfig", "MeshTuneResult", "expert_degrees", "scale_microbatches", "tune_mesh"]

Progress = Callable[[str], None]


@dataclass(kw_only=True, frozen=True)
class MeshTuneConfig:
    """What to choose a mesh for.

    ``devices``: the number of accelerators (pp x dp). ``global_batch``:
    samples per optimizer step over all replicas (a multiple of dp x the
    profile's micro-batch size for a pp to be considered).
    ``memory_cap_bytes``: per device. ``collectives``: the data-parallel (and
    expert-parallel) group costs; None takes the Profile's ``collectives``.
    ``p2p_link``: pipeline sends between stages where the Profile has no
    LinkCost for a pair (None: the Profile's links only). ``pipeline_degrees``:
    the pp values to try (None: every divisor of ``devices`` that fits).
    ``ep``: expert-parallel degree inside each data-parallel group (None:
    searched where the profile has MoE layers, see the module doc).
    ``max_microbatches``: the most micro-batches per replica (module doc).
    ``refine_s``: seconds of partition refinement for the winner (0: none).
    ``registry``: the schedules to search; ``families``: its placement
    families to search (default: the default registry's).
    ``tensor_parallel``: also search tp and cp (module doc; False: pp x dp only).
    ``model_facts``: the model's sizes that tp and cp must divide, as
    ``octopipe.ir.check_mesh_model`` reads them (``heads``, ``mamba_heads``,
    ``ffn``, ``sequence``, ``mamba_layers``); without them (and without
    ``tp_degrees`` / ``cp_degrees``) tp = cp = 1. ``tp_degrees`` /
    ``cp_degrees``: the degrees to try (None: tp over the divisors of the
    device count up to ``node_size``, cp over the divisors of the sequence up
    to ``max_cp``). ``tp_cp_with_dp=False``: tp or cp > 1 only with dp = 1
    (the runtime also runs FSDP over dp with them, the default). With tp or
    cp > 1, ep is 1 (the runtime refuses expert parallelism with them).
    ``sequence_parallel``: meshes with tp > 1 run Megatron sequence
    parallelism (plans carry ``mesh.sequence_parallel``).
    """

    devices: int
    global_batch: int
    memory_cap_bytes: int
    collectives: GroupLinks | None = None
    p2p_link: Link | None = None
    pipeline_degrees: tuple[int, ...] | None = None
    families: tuple[str, ...] = FAMILIES
    placements: tuple[CollectivePlacement, ...] = PLACEMENTS
    ep: int | None = None
    max_microbatches: int = 64
    overlap_hidden_fraction: float = 0.0
    refine_s: float = 0.0
    registry: ScheduleRegistry = DEFAULT_SCHEDULES
    tensor_parallel: bool = True
    model_facts: Mapping[str, int] | None = None
    tp_degrees: tuple[int, ...] | None = None
    cp_degrees: tuple[int, ...] | None = None
    node_size: int = 8
    max_cp: int = 32
    tp_cp_with_dp: bool = True
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.devices < 1 or self.global_batch < 1:
            raise ValueError(f"devices and global_batch must be >= 1, got {self.devices} and {self.global_batch}")
        if self.memory_cap_bytes < 1:
            raise ValueError(f"memory_cap_bytes must be >= 1, got {self.memory_cap_bytes}")
        self.registry.require_baseline()
        known = self.registry.families
        unknown = [f for f in self.families if f not in known]
        if unknown or not self.families:
            raise ValueError(f"families {unknown or '()'}: choose from {', '.join(known)}")
        if not self.placements:
            raise ValueError("placements is empty: give at least one CollectivePlacement")
        if self.max_microbatches < 1:
            raise ValueError(f"max_microbatches must be >= 1, got {self.max_microbatches}")
        if (self.ep is not None and self.ep < 1) or self.refine_s < 0:
            raise ValueError(f"ep must be >= 1 and refine_s >= 0, got {self.ep} and {self.refine_s}")
        for pp in self.pipeline_degrees or ():
            if pp < 1 or self.devices % pp:
                raise ValueError(f"pipeline degree {pp} does not divide {self.devices} devices")
        if self.node_size < 1 or self.max_cp < 1:
            raise ValueError(f"node_size and max_cp must be >= 1, got {self.node_size} and {self.max_cp}")
        for degree in (*(self.tp_degrees or ()), *(self.cp_degrees or ())):
            if degree < 1 or self.devices % degree:
                raise ValueError(f"tp / cp degree {degree} does not divide {self.devices} devices")


@dataclass(kw_only=True, frozen=True)
class MeshCandidate:
    """One (pp, dp, tp, cp, ep, m): its best plan's step, or why it has none."""

    pp: int
    dp: int
    num_microbatches: int
    ep: int = 1
    tp: int = 1
    cp: int = 1
    microbatch_size: int
    step_time_us: float
    fits: bool
    schedule: str = ""
    placement: str = ""
    peak_memory_bytes: int = 0
    reason: str = ""


@dataclass(kw_only=True, frozen=True)
class MeshTuneResult:
    """The chosen mesh and plan (verified, within the cap), 1F1B on the same mesh, and every (pp, dp, m) tried."""

    plan: plan_pb2.Plan
    estimate: Estimate
    baseline: Estimate
    pp: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    description: str
    ep: int = 1
    tp: int = 1
    cp: int = 1
    candidates: tuple[MeshCandidate, ...] = field(default_factory=tuple)
    simulations: int = 0
    seconds: float = 0.0

    @property
    def speedup(self) -> float:
        """1F1B's step time on the same mesh / the chosen plan's."""
        return self.baseline.step_time_us / self.estimate.step_time_us


class _MeshEvaluator(Evaluator):
    """An Evaluator whose cost models time the mesh's collectives."""

    def __init__(
        self,
        profile: profile_pb2.Profile,
        config: MeshTuneConfig,
        links: GroupLinks,
        pp: int,
        m: int,
        ep: int,
        tp: int = 1,
        cp: int = 1,
    ) -> None:
        super().__init__(
            profile,
            num_ranks=pp,
            num_microbatches=m,
            memory_caps=dict.fromkeys(range(pp), config.memory_cap_bytes),
            default_link=config.p2p_link,
            overlap=OverlapModel(hidden_fraction=config.overlap_hidden_fraction),
            registry=config.registry,
        )
        self.collectives = links
        self.tp, self.cp = tp, cp
        self.dp, self.ep = config.devices // (pp * tp * cp), ep
        self.sequence_parallel = config.sequence_parallel and tp > 1
        if tp * cp > 1:
            self.layers = replace(self.layers, tp=tp, cp=cp, sequence_parallel=self.sequence_parallel)

    def cost_model(self, bounds: Sequence[int], recompute: Sequence[str] = ()) -> CostModel:
        if any(label != "none" for label in recompute):  # the runtime refuses recomputation with a mesh
            raise ValueError("recomputation is not searched with a mesh (dp, tp, cp or ep > 1)")
        return replace(super().cost_model(bounds), collectives=self.collectives)

    def mesh_plan(self, candidate: Candidate, policy: CollectivePlacement) -> plan_pb2.Plan | None:
        compute = self.compute(candidate, self.cost_model(candidate.bounds))
        if compute is None:
            return None
        placed = place_collectives(compute, candidate.placement, policy)
        plan = self.assemble(candidate, placed, name="candidate", validate=False)
        plan.mesh.dp, plan.mesh.ep = self.dp, self.ep
        if self.tp * self.cp > 1:
            plan.mesh.tp, plan.mesh.cp = self.tp, self.cp
            plan.mesh.sequence_parallel = self.sequence_parallel
        plan.labels["collectives"] = policy.name
        return plan


def tune_mesh(
    profile: profile_pb2.Profile, config: MeshTuneConfig, *, progress: Progress | None = None
) -> MeshTuneResult:
    """Choose pp x dp (x tp x cp) x m, schedule and collective placement for ``config.devices`` devices
    (module doc).

    Raises ValueError naming what to change when no (pp, dp, m) has a plan within the cap.
    """
    start = time.perf_counter()
    links = config.collectives if config.collectives is not None else GroupLinks.from_profile(profile)
    if links is None:
        raise ValueError(
            "no collective costs: add CollectiveCost entries (GROUP_KIND_DATA_PARALLEL) to the profile "
            "or pass MeshTuneConfig.collectives"
        )
    layers = Layers.from_profile(profile)
    b = max(1, profile.microbatch_size)
    choice = parallel_degrees(
        profile,
        config.devices,
        facts=config.model_facts if config.tensor_parallel else None,
        tp_degrees=config.tp_degrees if config.tensor_parallel else None,
        cp_degrees=config.cp_degrees if config.tensor_parallel else None,
        node_size=config.node_size,
        max_cp=config.max_cp,
    )
    candidates: list[MeshCandidate] = []
    points: list[tuple[float, int, int, int, int, list[int]]] = []  # (bound, tp, cp, pp, k, eps)
    scaled_by: dict[int, profile_pb2.Profile] = {}
    for tp, cp in choice.pairs:
        inner = config.devices // (tp * cp)
        degrees = config.pipeline_degrees or tuple(pp for pp in range(1, inner + 1) if inner % pp == 0)
        for pp in degrees:
            if inner % pp:
                continue
            dp = inner // pp
            eps = expert_degrees(profile, dp, config.ep)
            if tp * cp > 1:  # the runtime splits experts' hidden units over tp instead: ep = 1 with tp or cp
                eps = [e for e in eps if e == 1]
            why = ""
            if pp > len(layers):
                why = f"{pp} pipeline ranks need at least {pp} layers; the profile has {len(layers)}"
            elif not eps:
                why = f"ep={config.ep} does not divide dp={dp}" if tp * cp == 1 else "ep > 1 with tp or cp > 1"
            elif tp * cp > 1 and dp > 1 and not config.tp_cp_with_dp:
                why = f"tp={tp}, cp={cp} with dp={dp}: tp_cp_with_dp=False allows tp or cp > 1 only with dp = 1"
            elif config.global_batch % (dp * b):
                why = f"global batch {config.global_batch} is not a multiple of dp x micro-batch size = {dp * b}"
            if why:
                candidates.append(
                    MeshCandidate(
                        pp=pp,
                        dp=dp,
                        tp=tp,
                        cp=cp,
                        num_microbatches=0,
                        microbatch_size=0,
                        step_time_us=0,
                        fits=False,
                        reason=why,
                    )
                )
                continue
            per_replica = config.global_batch // (dp * b)
            k = next(
                k
                for k in range(1, per_replica + 1)
                if per_replica % k == 0 and per_replica // k <= config.max_microbatches
            )
            if k not in scaled_by:
                scaled_by[k] = scale_microbatches(profile, k)
            bound = 0.0
            if tp * cp > 1:
                sp = config.sequence_parallel and tp > 1
                shares = replace(Layers.from_profile(scaled_by[k]), tp=tp, cp=cp, sequence_parallel=sp)
                bound = step_lower_bound_us(shares, pp, per_replica // k, config.overlap_hidden_fraction)
            points.append((bound, tp, cp, pp, k, eps))
    # (1, 1) first, in pipeline order (the pp x dp search of before); then the others from the lowest bound up
    points.sort(key=lambda point: (point[1] * point[2] > 1, point[0]))
    best: tuple[Score, _MeshEvaluator, Candidate, plan_pb2.Plan, str] | None = None
    simulations = 0
    for bound, tp, cp, pp, k, eps in points:
        dp, m = config.devices // (pp * tp * cp), config.global_batch // (config.devices // (pp * tp * cp) * b * k)
        if tp * cp > 1 and best is not None and best[0].fits and bound >= best[0].step_time_us:
            candidates.append(
                MeshCandidate(
                    pp=pp,
                    dp=dp,
                    tp=tp,
                    cp=cp,
                    num_microbatches=m,
                    microbatch_size=k * b,
                    step_time_us=0,
                    fits=False,
                    reason=f"skipped: no plan can beat {best[0].step_time_us:.0f} us (bound {bound:.0f} us)",
                )
            )
            continue
        for ep in eps:
            ev = _MeshEvaluator(scaled_by[k], config, links, pp, m, ep, tp, cp)
            found = _search_degree(ev, config, len(layers))
            simulations += ev.evaluations
            if found is None:
                continue
            score, candidate, plan, label = found
            peak = max(r.peak_memory_bytes for r in score.estimate.ranks) if score.estimate is not None else 0
            candidates.append(
                MeshCandidate(
                    pp=pp,
                    dp=dp,
                    ep=ep,
                    tp=tp,
                    cp=cp,
                    num_microbatches=m,
                    microbatch_size=k * b,
                    step_time_us=score.step_time_us,
                    fits=score.fits,
                    schedule=label,
                    placement=candidate.family.label,
                    peak_memory_bytes=peak,
                    reason="" if score.fits else f"{peak} bytes at peak on some rank, over the cap",
                )
            )
            if progress is not None:
                progress(
                    f"pp={pp} dp={dp} tp={tp} cp={cp} ep={ep} m={m}: {label}, step {score.step_time_us / 1e3:.1f} ms, "
                    f"fits={score.fits}"
                )
            if best is None or score < best[0]:
                best = (score, ev, candidate, plan, label)
    if best is None:
        reasons = "; ".join(f"pp={c.pp}: {c.reason}" for c in candidates)
        raise ValueError(
            f"no pp x dp x m for {config.devices} devices and global batch {config.global_batch} can run ({reasons}): "
            "give a global batch that dp x micro-batch size divides, an ep that divides dp, or fewer devices"
        )
    if not best[0].fits:
        closest = f" (closest: pp={best[1].num_ranks}, {best[0].excess_bytes} bytes over)"
        raise ValueError(
            f"no pp x dp x m for {config.devices} devices and global batch {config.global_batch} has a plan within "
            f"the memory cap of {config.memory_cap_bytes} bytes{closest}: raise the cap, shrink the micro-batch, "
            "or give a global batch that more pipeline degrees divide"
        )
    score, ev, candidate, plan, label = best
    bounds = candidate.bounds
    if config.refine_s > 0:
        bounds, score, simulations = _refine(ev, candidate, plan, score, config.refine_s, simulations)
    final = _finish(ev, plan, bounds, candidate.schedule)
    estimate = simulate(final, ev.cost_model(bounds)).estimate  # verifies and enforces the cap
    baseline = _baseline(ev, len(layers))
    simulations += 2
    sizes = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    return MeshTuneResult(
        plan=final,
        estimate=estimate,
        baseline=baseline,
        pp=ev.num_ranks,
        dp=ev.dp,
        ep=ev.ep,
        tp=ev.tp,
        cp=ev.cp,
        num_microbatches=ev.m,
        microbatch_size=ev.microbatch_size,
        description=f"{label}, layers per stage {sizes}",
        candidates=tuple(candidates),
        simulations=simulations,
        seconds=time.perf_counter() - start,
    )


def expert_degrees(profile: profile_pb2.Profile, dp: int, ep: int | None) -> list[int]:
    """The ep values to try with ``dp`` replicas: ``[ep]`` if given and it divides dp (else none); otherwise
    every divisor of dp that divides each MoE layer's expert count, or ``[1]`` without MoE layers."""
    if ep is not None:
        return [ep] if dp % ep == 0 else []
    experts = [layer.num_experts for layer in profile.layers if layer.num_experts]
    return [e for e in range(1, dp + 1) if dp % e == 0 and all(n % e == 0 for n in experts)] if experts else [1]


def _search_degree(
    ev: _MeshEvaluator, config: MeshTuneConfig, num_layers: int
) -> tuple[Score, Candidate, plan_pb2.Plan, str] | None:
    """The best (score, candidate, plan, label) for one (pp, dp, m): every registry schedule under every
    collective placement on a partition balanced by each layer's m x (F + I + W) plus its all-gather and
    reduce-scatter time; the family's best order also on equal layer counts; and the baseline (1F1B,
    equal counts, collectives prefetched), so the result is never slower than the baseline when both fit."""
    link = ev.collectives.data_parallel_link(0, ev.dp * ev.tp * ev.cp)  # a dp group spans dp x cp x tp ranks
    share = (ev.dp - 1) / ev.dp / link.bandwidth_bytes_per_second * 1e6
    costs = ev.layers.shares
    weights = [
        ev.m * ev.layers.time_us(i) + share * (costs[i].parameter_bytes + costs[i].gradient_bytes)
        for i in range(num_layers)
    ]
    found: tuple[Score, Candidate, plan_pb2.Plan, str] | None = None

    def consider(score: Score, candidate: Candidate, plan: plan_pb2.Plan, label: str) -> None:
        nonlocal found
        if found is None or score < found[0]:
            found = (score, candidate, plan, label)

    prefetch = CollectivePlacement(prefetch=True, reshard=False)
    baseline = Candidate(bounds=equal_bounds(num_layers, ev.num_ranks), family=Placement.linear(), schedule="1f1b")
    plan = ev.mesh_plan(baseline, prefetch)
    assert plan is not None
    consider(ev.score_plan(plan, ev.cost_model(baseline.bounds)), baseline, plan, _label(baseline, prefetch))
    for label in config.families:
        family = config.registry.placement(label)
        num_stages = family.stages_per_rank * ev.num_ranks
        if num_stages > num_layers:
            continue
        bounds = balanced_bounds(weights, num_stages)
        model = ev.cost_model(bounds)
        best: tuple[Score, Candidate, plan_pb2.Plan, str] | None = None
        for entry in config.registry.in_family(label):
            candidate = Candidate(bounds=bounds, family=family, schedule=entry.name)
            for policy in config.placements:
                plan = ev.mesh_plan(candidate, policy)
                if plan is None:
                    break
                score = ev.score_plan(plan, model)
                if best is None or score < best[0]:
                    best = (score, candidate, plan, _label(candidate, policy))
                if score.fits:
                    break  # later policies only add RESHARDs: no faster
        if best is None:
            continue
        consider(*best)
        equal = replace(best[1], bounds=equal_bounds(num_layers, num_stages))
        if equal.bounds != bounds:
            consider(ev.score_plan(best[2], ev.cost_model(equal.bounds)), equal, best[2], best[3])
    return found


def _label(candidate: Candidate, policy: CollectivePlacement) -> str:
    return f"{candidate.schedule} on {candidate.family.label} placement, collectives {policy.name}"


def _refine(
    ev: _MeshEvaluator, candidate: Candidate, plan: plan_pb2.Plan, score: Score, seconds: float, simulations: int
) -> tuple[tuple[int, ...], Score, int]:
    """Boundary moves with the action order fixed (the co-optimizer's partition phase)."""
    before = ev.evaluations
    search = Search(ev, kicks=0, time_budget_s=seconds)
    search.placement = candidate.placement
    bounds, found = search.descend(plan, candidate.bounds, score)
    return bounds, found, simulations + ev.evaluations - before


def _finish(ev: _MeshEvaluator, skeleton: plan_pb2.Plan, bounds: Sequence[int], schedule: str) -> plan_pb2.Plan:
    plan = plan_pb2.Plan()
    plan.CopyFrom(skeleton)
    plan.name = f"tuned-{schedule}-pp{ev.num_ranks}-dp{ev.dp}{_parallel_name(ev)}-m{ev.m}"
    for s, stage in enumerate(plan.stages):
        del stage.layer_names[:]
        stage.layer_names.extend(ev.layers.names[bounds[s] : bounds[s + 1]])
    plan.labels["schedule"] = schedule
    validate_plan(plan)
    return plan


def _parallel_name(ev: _MeshEvaluator) -> str:
    return f"-tp{ev.tp}-cp{ev.cp}" if ev.tp * ev.cp > 1 else ""


def _baseline(ev: _MeshEvaluator, num_layers: int) -> Estimate:
    """1F1B, equal layer counts, collectives prefetched, on the same mesh; memory reported, not enforced."""
    candidate = Candidate(bounds=equal_bounds(num_layers, ev.num_ranks), family=Placement.linear(), schedule="1f1b")
    plan = ev.mesh_plan(candidate, CollectivePlacement(prefetch=True, reshard=False))
    assert plan is not None
    plan.name = f"1f1b-equal-pp{ev.num_ranks}-dp{ev.dp}{_parallel_name(ev)}-m{ev.m}"
    config = SimulationConfig(enforce_memory_caps=False, critical_path=False)
    return simulate(plan, ev.cost_model(candidate.bounds), config=config).estimate
