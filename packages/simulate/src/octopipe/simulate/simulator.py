"""The public entry points: ``simulate`` a plan on a cost model, ``verify_plan`` statically."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from octopipe.estimate.v1 import estimate_pb2
from octopipe.ir.errors import MemoryCapError
from octopipe.ir.plan import validate_plan
from octopipe.ir.program import SENDS, Program, compile_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.bind import Bound, bind
from octopipe.simulate.costs import CostModel
from octopipe.simulate.engine import Timing, run
from octopipe.simulate.estimate import (
    Estimate,
    PathStep,
    RankEstimate,
    communication_overlap,
    critical_path,
    label_proto,
    stream_of,
)
from octopipe.simulate.memory import MemoryUse, memory_events, memory_use

__all__ = ["ActionTiming", "Simulation", "SimulationConfig", "simulate", "verify_plan"]


@dataclass(kw_only=True, frozen=True)
class SimulationConfig:
    """How to simulate.

    ``enforce_memory_caps``: raise MemoryCapError when a rank exceeds its plan
    cap (otherwise report it: ``Estimate.fits``). ``tokens_per_sample``: report
    tokens per second too. ``critical_path``: compute it (skip it in tight
    search loops).
    """

    enforce_memory_caps: bool = True
    tokens_per_sample: int | None = None
    critical_path: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_sample is not None and self.tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be >= 1 (or None), got {self.tokens_per_sample}")


@dataclass(kw_only=True, frozen=True, slots=True)
class ActionTiming:
    """One simulated action: where it ran and when. ``peer`` is the other rank of a transfer."""

    rank: int
    step: int
    action: str
    stream: str
    start_us: float
    end_us: float
    peer: int | None = None


@dataclass(frozen=True, eq=False)
class Simulation:
    """A simulated step: the :class:`Estimate` plus the full timeline behind it."""

    estimate: Estimate
    program: Program = field(repr=False)
    timing: Timing = field(repr=False)
    bound: Bound = field(repr=False)

    @property
    def num_ranks(self) -> int:
        return self.program.num_ranks

    def timeline(self, rank: int | None = None) -> list[ActionTiming]:
        """Every action of ``rank`` (or of all ranks) in program order."""
        ranks = range(self.program.num_ranks) if rank is None else (rank,)
        out = []
        for r in ranks:
            for step, label in enumerate(self.program.labels[r]):
                out.append(
                    ActionTiming(
                        rank=r,
                        step=step,
                        action=self.program.text(r, step),
                        stream=stream_of(label[0]),
                        start_us=self.timing.starts[r][step],
                        end_us=self.timing.ends[r][step],
                        peer=self.peer(r, step),
                    )
                )
        return out

    def peer(self, rank: int, step: int) -> int | None:
        """The other rank of a SEND or RECV step, else None."""
        transfer = self.program.transfer_of[rank][step]
        if transfer < 0:
            return None
        kind = self.program.codes[rank][step]
        if kind in SENDS:
            return self.program.receiver[transfer][0]
        return self.program.sender[transfer][0]

    def memory_curve(self, rank: int) -> list[tuple[float, int]]:
        """The rank's total bytes over time: (time, bytes from then on), starting at (0, static)."""
        total = self.bound.static_bytes[rank]
        curve = [(0.0, total)]
        for time, delta in memory_events(self.program, self.timing, self.bound, rank):
            total += delta
            if curve[-1][0] == time:
                curve[-1] = (time, total)
            else:
                curve.append((time, total))
        return curve

    def to_proto(self, *, timelines: bool = False) -> estimate_pb2.Estimate:
        """The ``octopipe.estimate.v1.Estimate``; with ``timelines`` also every simulated action."""
        message = self.estimate.to_proto()
        message.labels["simulator"] = "octopipe.simulate"
        if timelines:
            for rank in range(self.program.num_ranks):
                timeline = message.timelines.add(rank=rank, step=0)
                timeline.peak_memory_bytes = self.estimate.ranks[rank].peak_memory_bytes
                for step, label in enumerate(self.program.labels[rank]):
                    timeline.records.add(
                        action=label_proto(label),
                        stream=stream_of(label[0]),
                        start_us=self.timing.starts[rank][step],
                        end_us=self.timing.ends[rank][step],
                    )
        return message


def simulate(
    plan: plan_pb2.Plan,
    costs: profile_pb2.Profile | CostModel,
    *,
    config: SimulationConfig | None = None,
) -> Simulation:
    """Simulate one step of ``plan``; reject it (a PlanError subclass) if it cannot run.

    ``costs`` is a Profile (stage costs are the sums of each stage's layers;
    every rank pair the plan uses needs a LinkCost) or a :class:`CostModel`.
    Every check of ``verify_plan`` runs, except that, for speed, which optional
    fields are set is not re-checked: plans from ``build_plan``, ``load_plan``
    and the generators are valid; run ``validate_plan`` on hand-made protos.

    With a mesh, one pipeline replica is simulated (every replica runs the same
    programs at the same times); collectives are timed and memory is counted
    as ``octopipe.simulate.bind`` describes, and ``samples_per_step`` counts
    every replica's micro-batches (m x micro-batch size x dp).
    """
    config = config or SimulationConfig()
    model = costs if isinstance(costs, CostModel) else CostModel.from_profile(plan, costs)
    program = compile_plan(plan)
    bound = bind(program, model)
    timing = run(program, bound.durations, bound.transfer_us)
    return _finish(plan, program, timing, bound, config)


def verify_plan(plan: plan_pb2.Plan, costs: profile_pb2.Profile | CostModel | None = None) -> None:
    """Reject a plan that cannot run, naming the rank, step and action.

    Checks structure (``validate_plan``), that every action's inputs exist
    before it, that every micro-batch has one F and one B (or I and W) per stage,
    that sends and receives pair up in order, that there is no circular wait
    and, given costs, that no rank exceeds its memory cap.
    """
    validate_plan(plan)
    if costs is not None:
        simulate(plan, costs, config=SimulationConfig(enforce_memory_caps=True, critical_path=False))
        return
    program = compile_plan(plan)
    run(program, [[0.0] * len(row) for row in program.codes], [0.0] * program.num_transfers)


def _finish(
    plan: plan_pb2.Plan, program: Program, timing: Timing, bound: Bound, config: SimulationConfig
) -> Simulation:
    step_time = timing.step_time_us + bound.tail_us  # the tied-gradient exchange closes the step
    caps = [rp.memory_cap_bytes if rp.HasField("memory_cap_bytes") else None for rp in plan.ranks]
    uses = [memory_use(program, timing, bound, rank, caps[rank]) for rank in range(program.num_ranks)]
    if config.enforce_memory_caps:
        for rank, use in enumerate(uses):
            _check_cap(plan, program, rank, use, caps[rank])
    ranks = []
    for rank, use in enumerate(uses):
        comm, hidden = communication_overlap(program, timing, rank)
        busy = timing.busy_us[rank]
        idle = step_time - busy
        ranks.append(
            RankEstimate(
                rank=rank,
                busy_us=busy,
                idle_us=idle,
                bubble_ratio=idle / step_time if step_time > 0 else 0.0,
                static_memory_bytes=use.static_bytes,
                peak_activation_bytes=use.peak_activation_bytes,
                peak_memory_bytes=use.peak_bytes,
                peak_memory_time_us=use.peak_time_us,
                memory_cap_bytes=caps[rank],
                communication_us=comm,
                hidden_communication_us=hidden,
            )
        )
    # every data-parallel replica of the pipeline runs the same step on its own micro-batches
    samples = program.num_microbatches * bound.microbatch_size * program.dp
    per_second = samples * 1e6 / step_time if step_time > 0 else math.inf
    path = critical_path(program, timing) if config.critical_path else []
    total_idle = sum(r.idle_us for r in ranks)
    estimate = Estimate(
        plan_name=plan.name,
        plan_version=plan.version,
        num_microbatches=program.num_microbatches,
        samples_per_step=samples,
        step_time_us=step_time,
        samples_per_second=per_second,
        tokens_per_second=None if config.tokens_per_sample is None else per_second * config.tokens_per_sample,
        bubble_ratio=total_idle / (len(ranks) * step_time) if step_time > 0 and ranks else 0.0,
        communication_us=sum(r.communication_us for r in ranks),
        hidden_communication_us=sum(r.hidden_communication_us for r in ranks),
        ranks=tuple(ranks),
        critical_path=tuple(
            PathStep(
                rank=r,
                step=s,
                action=program.text(r, s),
                stream=stream_of(program.codes[r][s]),
                start_us=timing.starts[r][s],
                end_us=timing.ends[r][s],
            )
            for r, s in path
        ),
    )
    return Simulation(estimate=estimate, program=program, timing=timing, bound=bound)


def _check_cap(plan: plan_pb2.Plan, program: Program, rank: int, use: MemoryUse, cap: int | None) -> None:
    if cap is None or use.peak_bytes <= cap or use.over_cap_time_us is None:
        return
    step = use.over_cap_step or 0
    action = program.text(rank, step) if program.labels[rank] else ""
    raise MemoryCapError(
        plan,
        rank,
        step,
        action,
        f"rank {rank} goes over its memory cap of {cap} bytes at t={use.over_cap_time_us:g} us and peaks at "
        f"{use.peak_bytes} bytes (t={use.peak_time_us:g} us), {use.peak_bytes - cap} bytes over: keep fewer "
        f"micro-batches in flight on rank {rank}, move layers off it, or raise its cap",
        cap_bytes=cap,
        peak_bytes=use.peak_bytes,
        time_us=use.over_cap_time_us,
    )
