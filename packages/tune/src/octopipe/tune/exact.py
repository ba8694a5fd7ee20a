"""An exact baseline: the scheduling problem for a fixed partition and placement as a MILP (HiGHS).

For small instances, to measure how far the heuristics are from optimal.
Needs the ``exact`` extra (``pip install 'octopipe-tune[exact]'``: highspy),
imported only when called.

The model. One start time per computation F(s, mb), I(s, mb), W(s, mb) (the
backward always split), durations from the cost model. Precedences: F(s-1, mb)
-> F(s, mb) and I(s+1, mb) -> I(s, mb), each plus the link's transfer time
when the stages are on different ranks; the last stage's F -> its I; I -> W.
Each stage runs its F's, its I's and its W's in micro-batch order (micro-batches
are interchangeable, so this loses nothing and removes symmetric solutions).
Computations of one rank do not overlap: for every pair whose order is not
already implied, a binary chooses it (big-M). Memory: at the start of every F
on a rank, the static bytes plus the activations of the F's ordered before it
(and its own) minus what the I's and W's ordered before it freed stay within
the rank's cap. Objective: the makespan. Communication is a pure delay (the
simulator also serialises transfers on a channel and posts receives in program
order, so with non-zero transfer times its step time can exceed the model's).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from octopipe.ir import Action, ActionKind, add_p2p_actions, parse_action
from octopipe.plan.v1 import plan_pb2
from octopipe.simulate import CostModel, Estimate, SimulationConfig, StageSpec, build_plan, simulate

__all__ = ["ExactResult", "exact_schedule"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(kw_only=True, frozen=True)
class ExactResult:
    """The solver's best schedule: its plan and simulated estimate, the model's bounds, and the time taken."""

    plan: plan_pb2.Plan
    estimate: Estimate
    makespan_us: float
    lower_bound_us: float
    optimal: bool
    seconds: float

    @property
    def gap(self) -> float:
        """(makespan - lower bound) / makespan: 0 when proven optimal."""
        return (self.makespan_us - self.lower_bound_us) / self.makespan_us if self.makespan_us > 0 else 0.0


def exact_schedule(
    costs: CostModel,
    placement: Sequence[int],
    num_microbatches: int,
    *,
    memory_caps: Mapping[int, int] | None = None,
    time_limit_s: float = 60.0,
    upper_bound_us: float | None = None,
    initial: Mapping[int, Sequence[Action]] | None = None,
) -> ExactResult:
    """Solve the scheduling MILP (see the module doc) with HiGHS; return the best schedule found.

    ``upper_bound_us`` (e.g. a heuristic's step time) tightens the model;
    ``initial`` (a heuristic's compute order per rank, F/I/W/B, within the
    caps) is given to the solver as its first solution, so the result is
    never worse than it.
    Raises ValueError when the caps make the problem infeasible, and
    ImportError (saying which extra to install) without highspy.
    """
    try:
        import highspy  # noqa: PLC0415 - optional: the `exact` extra
    except ImportError:
        raise ImportError("exact_schedule needs highspy: pip install 'octopipe-tune[exact]'") from None
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if len(costs.stages) != len(placement):
        raise ValueError(f"the cost model has {len(costs.stages)} stages but the placement {len(placement)}")
    started = time.perf_counter()
    model = _Model(costs, list(placement), num_microbatches, dict(memory_caps or {}), upper_bound_us)
    highs = highspy.Highs()  # type: ignore[no-untyped-call]
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("random_seed", 0)
    makespan = model.build(highs)
    highs.changeColCost(makespan.index, 1.0)
    highs.changeObjectiveSense(highspy.ObjSense.kMinimize)
    if initial is not None:  # after the objective is set: changing it drops a given solution
        model.start_from(highs, initial, makespan)
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution
        raise ValueError(
            f"the exact model found no schedule ({highs.modelStatusToString(status)}): the memory caps may be "
            "too tight for this partition, or the time limit too short"
        )
    order = model.order(highs)
    plan = build_plan(
        stages=[StageSpec(rank=r, layer_names=()) for r in placement],
        actions=add_p2p_actions(order, dict(enumerate(placement))),
        num_microbatches=num_microbatches,
        name=f"exact-p{model.num_ranks}-m{num_microbatches}",
        memory_caps=model.caps,
        labels={"schedule": "exact", "solver": "highs"},
    )
    estimate = simulate(plan, costs).estimate
    value = highs.val(makespan)
    optimal = status == highspy.HighsModelStatus.kOptimal
    return ExactResult(
        plan=plan,
        estimate=estimate,
        makespan_us=value,
        lower_bound_us=value if optimal else max(0.0, info.mip_dual_bound),
        optimal=optimal,
        seconds=time.perf_counter() - started,
    )


class _Model:
    def __init__(
        self, costs: CostModel, placement: list[int], m: int, caps: dict[int, int], upper: float | None
    ) -> None:
        self.costs, self.placement, self.m, self.caps = costs, placement, m, caps
        self.num_stages = len(placement)
        self.num_ranks = max(placement) + 1
        self.ops = [(kind, s, mb) for s in range(self.num_stages) for kind in (_F, _I, _W) for mb in range(m)]
        self.index = {op: i for i, op in enumerate(self.ops)}
        # the runtime's costs too (CostModel.action_us / boundary_us): the terms the simulator reads
        self.duration = [costs.action_us(s, kind) for kind, s, _ in self.ops]
        self.edges = self._edges()
        total = sum(self.duration) + sum(delay for _, _, delay in self.edges)
        self.big = min(total, upper * 1.001 + 1.0) if upper is not None else total
        self.starts: list[Any] = []
        self.before: dict[tuple[int, int], Any] = {}

    def transfer(self, source_stage: int, destination_stage: int, boundary_stage: int) -> float:
        a, b = self.placement[source_stage], self.placement[destination_stage]
        if a == b:
            return 0.0
        return self.costs.boundary_us(a, b, self.costs.stages[boundary_stage].output_bytes)

    def _edges(self) -> list[tuple[int, int, float]]:
        edges: list[tuple[int, int, float]] = []
        ix, last = self.index, self.num_stages - 1
        for s in range(self.num_stages):
            for mb in range(self.m):
                if s > 0:
                    edges.append((ix[_F, s - 1, mb], ix[_F, s, mb], self.transfer(s - 1, s, s - 1)))
                if s < last:
                    edges.append((ix[_I, s + 1, mb], ix[_I, s, mb], self.transfer(s + 1, s, s)))
                else:
                    edges.append((ix[_F, s, mb], ix[_I, s, mb], 0.0))
                edges.append((ix[_I, s, mb], ix[_W, s, mb], 0.0))
                if mb > 0:
                    for kind in (_F, _I, _W):
                        edges.append((ix[kind, s, mb - 1], ix[kind, s, mb], 0.0))
        return edges

    def _implied(self) -> list[set[int]]:
        """For each op, the ops that must come after it (transitive closure of the precedences)."""
        successors: list[list[int]] = [[] for _ in self.ops]
        indegree = [0] * len(self.ops)
        for a, b, _ in self.edges:
            successors[a].append(b)
            indegree[b] += 1
        topo = [i for i, d in enumerate(indegree) if d == 0]
        for i in topo:
            for j in successors[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    topo.append(j)
        after: list[set[int]] = [set() for _ in self.ops]
        for i in reversed(topo):
            for j in successors[i]:
                after[i].add(j)
                after[i] |= after[j]
        return after

    def build(self, highs: Any) -> Any:
        ub = self.big
        self.starts = [highs.addVariable(lb=0.0, ub=ub) for _ in self.ops]
        makespan = highs.addVariable(lb=0.0, ub=ub)
        for i, (_, _, _) in enumerate(self.ops):
            highs.addConstr(makespan - self.starts[i] >= self.duration[i])
        for a, b, delay in self.edges:
            highs.addConstr(self.starts[b] - self.starts[a] >= self.duration[a] + delay)
        after = self._implied()
        by_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for i, (_, s, _) in enumerate(self.ops):
            by_rank[self.placement[s]].append(i)
        for r, ops in enumerate(by_rank):
            highs.addConstr(makespan >= sum(self.duration[i] for i in ops))
            for x, i in enumerate(ops):
                for j in ops[x + 1 :]:
                    if j in after[i]:
                        self.before[i, j] = 1
                    elif i in after[j]:
                        self.before[i, j] = 0
                    else:
                        y = highs.addBinary()
                        self.before[i, j] = y
                        highs.addConstr(self.starts[j] - self.starts[i] + ub * (1 - y) >= self.duration[i])
                        highs.addConstr(self.starts[i] - self.starts[j] + ub * y >= self.duration[j])
            if r in self.caps:
                self._memory(highs, r, ops)
        return makespan

    def precedes(self, i: int, j: int) -> Any:
        """1 (or a binary) when op i runs before op j on their rank."""
        return self.before[i, j] if (i, j) in self.before else 1 - self.before[j, i]

    def _memory(self, highs: Any, rank: int, ops: list[int]) -> None:
        stages = self.costs.stages
        static = sum(stages[s].static_bytes for s, r in enumerate(self.placement) if r == rank)
        budget = self.caps[rank] - static
        for j in ops:
            kind, s, _ = self.ops[j]
            if kind is not _F:
                continue
            held: Any = stages[s].activation_bytes
            for i in ops:
                if i == j:
                    continue
                kind_i, s_i, _ = self.ops[i]
                size = (
                    stages[s_i].activation_bytes
                    if kind_i is _F
                    else -stages[s_i].freed_by_backward_input_bytes
                    if kind_i is _I
                    else -(stages[s_i].activation_bytes - stages[s_i].freed_by_backward_input_bytes)
                )
                if size:
                    held = held + size * self.precedes(i, j)
            if isinstance(held, int | float):
                if held > budget:
                    raise ValueError(f"rank {rank}'s cap cannot hold its static bytes and one forward")
                continue
            highs.addConstr(held <= budget)

    def start_from(self, highs: Any, initial: Mapping[int, Sequence[Action]], makespan: Any) -> None:
        """Give the solver the schedule ``initial`` (timed by the simulator) as a starting solution."""
        import highspy  # noqa: PLC0415 - optional: the `exact` extra

        plan = build_plan(
            stages=[StageSpec(rank=r) for r in self.placement],
            actions=add_p2p_actions(initial, dict(enumerate(self.placement))),
            num_microbatches=self.m,
        )
        simulation = simulate(plan, self.costs, config=SimulationConfig(enforce_memory_caps=False, critical_path=False))
        start = [0.0] * len(self.ops)
        for timing in simulation.timeline():
            if timing.stream != "compute":
                continue
            action = parse_action(timing.action)
            for part in action.computations:
                assert part.microbatch is not None
                if part.kind is ActionKind.FULL_BACKWARD:
                    start[self.index[_I, part.stage, part.microbatch]] = timing.start_us
                    start[self.index[_W, part.stage, part.microbatch]] = timing.start_us + self.costs.action_us(
                        part.stage, _I
                    )
                else:
                    start[self.index[part.kind, part.stage, part.microbatch]] = timing.start_us
        values = [0.0] * highs.getNumCol()
        for i, variable in enumerate(self.starts):
            values[variable.index] = start[i]
        values[makespan.index] = max(start[i] + self.duration[i] for i in range(len(self.ops)))
        for (i, j), y in self.before.items():
            if not isinstance(y, int):
                values[y.index] = 1.0 if start[i] < start[j] else 0.0
        solution = highspy.HighsSolution()
        solution.col_value = values
        highs.setSolution(solution)

    def order(self, highs: Any) -> dict[int, list[Action]]:
        values = [highs.val(v) for v in self.starts]
        order: dict[int, list[Action]] = {r: [] for r in range(self.num_ranks)}
        for i in sorted(range(len(self.ops)), key=lambda i: (values[i], self.ops[i][1], self.ops[i][2])):
            kind, s, mb = self.ops[i]
            order[self.placement[s]].append(Action(kind, s, mb))
        return order
