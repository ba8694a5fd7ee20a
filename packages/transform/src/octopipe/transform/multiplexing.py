"""Forward/backward multiplexing: one graph that runs F of one micro-batch and B of another, reordered for overlap.

:func:`multiplex` is a pure function of two graphs (a forward, and a backward:
fused, or the input-gradient graph B). It returns one graph
``(*forward_inputs, *backward_inputs) -> (*forward_outputs, *backward_outputs)``
whose nodes are ordered so that every collective (an MoE dispatch or combine
all-to-all, or any ``_c10d_functional`` op) is *in flight* while independent
compute runs: the collective is issued as soon as its input exists, its
``wait_tensor`` is placed as late as the other half's compute allows.

The order comes from a list scheduler that simulates one compute stream and
one communication channel with per-node costs (a :class:`CostModel`):

1. a collective whose inputs exist (and whose predecessor in the collective
   order is issued) is issued at once;
2. otherwise the *current* half runs its next ready compute node (in its own
   graph order, which keeps its memory behaviour);
3. when the current half has only waits left, a wait whose transfer is done
   is taken; if none is done, the other half becomes current (its compute
   hides the transfer); only when neither half can compute does the order
   stall on the wait that finishes first.

Each half keeps its own order of collectives, random ops and other impure ops.
The order of *all* collectives is fixed first, by scheduling with
:func:`~octopipe.transform.costs.roofline_costs` (a function of the graphs'
shapes alone); the given costs then place the compute around that order. So
ranks with different cost estimates (measured per rank, say) still issue
their collectives in the same order, which collectives require. The values
each half computes are those of the separate graphs: the same ops run on the
same inputs, so the outputs are bitwise equal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

from octopipe.transform.collectives import COLLECTIVE_KINDS, is_collective, is_wait, packet
from octopipe.transform.costs import CostModel, roofline_costs

__all__ = [
    "CommOverlap",
    "Multiplexed",
    "OverlapReport",
    "Simulation",
    "multiplex",
    "simulate",
]

Half = Literal["forward", "backward"]
HALF_KEY = "octopipe_half"


@dataclass(frozen=True)
class CommOverlap:
    """One collective of the multiplexed order and what runs while it is in flight."""

    issue: str
    wait: str
    kind: str
    half: Half
    #: compute nodes scheduled between the issue and the wait, by name, and by half
    compute_between: tuple[str, ...]
    other_half_between: int
    compute_between_us: float
    comm_us: float
    #: simulated: when the transfer ran, and how long the wait stalled the compute stream
    start_us: float
    finish_us: float
    exposed_us: float

    @property
    def hideable_fraction(self) -> float:
        """Share of the transfer that the compute between issue and wait could hide: min(1, compute / comm)."""
        return 1.0 if self.comm_us <= 0 else min(1.0, self.compute_between_us / self.comm_us)

    @property
    def hidden_fraction(self) -> float:
        """Share of the transfer hidden in the simulation (1 - stall / transfer time)."""
        return 1.0 if self.comm_us <= 0 else max(0.0, 1.0 - self.exposed_us / self.comm_us)


@dataclass(frozen=True)
class Simulation:
    """A simulated run of one node order: end time, total stall at waits, and each collective's timing."""

    makespan_us: float
    compute_us: float
    exposed_comm_us: float
    comm_us: float
    #: issue node -> (start, finish, exposed) in microseconds
    comms: dict[fx.Node, tuple[float, float, float]]


@dataclass(frozen=True)
class OverlapReport:
    """The overlap the multiplexed order achieves, and the simulated F-then-B baseline."""

    comms: tuple[CommOverlap, ...]
    multiplexed: Simulation
    sequential: Simulation

    @property
    def hidden_fraction(self) -> float:
        """Share of all collective time hidden under compute in the simulated multiplexed order."""
        total = self.multiplexed.comm_us
        return 1.0 if total <= 0 else max(0.0, 1.0 - self.multiplexed.exposed_comm_us / total)

    @property
    def speedup(self) -> float:
        """Simulated time of F then B over the time of the multiplexed graph."""
        return self.sequential.makespan_us / self.multiplexed.makespan_us if self.multiplexed.makespan_us else 1.0

    def format(self) -> str:
        """A readable table: one row per collective."""
        lines = [
            f"{'collective':<28} {'half':<9} {'kind':<11} {'comm us':>9} {'compute between us':>19} "
            f"{'other-half nodes':>16} {'hidden':>7}"
        ]
        for c in self.comms:
            lines.append(
                f"{c.issue:<28} {c.half:<9} {c.kind:<11} {c.comm_us:>9.1f} {c.compute_between_us:>19.1f} "
                f"{c.other_half_between:>16} {c.hidden_fraction:>7.1%}"
            )
        lines.append(
            f"hidden {self.hidden_fraction:.1%} of {self.multiplexed.comm_us:.1f} us of communication; simulated "
            f"{self.multiplexed.makespan_us:.1f} us multiplexed vs {self.sequential.makespan_us:.1f} us F then B "
            f"({self.speedup:.3f}x)"
        )
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Multiplexed:
    """The merged graph and how to call it (see the module docstring)."""

    graph: fx.GraphModule
    num_forward_inputs: int
    num_backward_inputs: int
    num_forward_outputs: int
    num_backward_outputs: int
    report: OverlapReport

    def __call__(
        self, forward_inputs: Sequence[object], backward_inputs: Sequence[object]
    ) -> tuple[list[object], list[object]]:
        """Run both halves: (forward outputs, backward outputs)."""
        if len(forward_inputs) != self.num_forward_inputs or len(backward_inputs) != self.num_backward_inputs:
            raise ValueError(
                f"expected {self.num_forward_inputs} forward and {self.num_backward_inputs} backward inputs, "
                f"got {len(forward_inputs)} and {len(backward_inputs)}"
            )
        with torch.no_grad():
            flat = list(self.graph(*forward_inputs, *backward_inputs))
        return flat[: self.num_forward_outputs], flat[self.num_forward_outputs :]


def _halves(forward: list[fx.Node], backward: list[fx.Node]) -> dict[fx.Node, Half]:
    half: dict[fx.Node, Half] = dict.fromkeys(forward, "forward")
    half.update(dict.fromkeys(backward, "backward"))
    return half


def _kind(node: fx.Node) -> Literal["comm", "wait", "compute"]:
    return "comm" if is_collective(node) else "wait" if is_wait(node) else "compute"


def _ordered(node: fx.Node) -> bool:
    """Nodes whose relative order within a half must not change: collectives, random and other impure ops."""
    if node.op != "call_function":
        return False
    if is_collective(node) or is_wait(node):
        return True
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.is_impure()


def _body(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _issued_by(wait: fx.Node) -> fx.Node | None:
    source = wait.all_input_nodes[0] if wait.all_input_nodes else None
    return source if source is not None and is_collective(source) else None


def simulate(order: Sequence[fx.Node], costs: CostModel) -> Simulation:
    """Run ``order`` on one compute stream and one in-order communication channel (all times in us)."""
    now = channel = compute = exposed = comm_total = 0.0
    comms: dict[fx.Node, tuple[float, float, float]] = {}
    for node in order:
        kind = _kind(node)
        if kind == "comm":
            duration = max(0.0, costs.comm_us(node))
            start = max(now, channel)
            channel = start + duration
            comm_total += duration
            comms[node] = (start, channel, 0.0)
        elif kind == "wait":
            source = _issued_by(node)
            if source is not None and source in comms:
                start, finish, _ = comms[source]
                stall = max(0.0, finish - now)
                comms[source] = (start, finish, stall)
                exposed += stall
                now += stall
        else:
            cost = max(0.0, costs.compute_us(node))
            now += cost
            compute += cost
    return Simulation(makespan_us=now, compute_us=compute, exposed_comm_us=exposed, comm_us=comm_total, comms=comms)


def _first_half(forward: list[fx.Node], backward: list[fx.Node]) -> Half:
    """The half whose first collective needs fewer nodes before it starts (a comm gets in flight sooner)."""

    def lead(nodes: list[fx.Node]) -> int:
        return next((i for i, n in enumerate(nodes) if _kind(n) == "comm"), len(nodes) + 1)

    return "forward" if lead(forward) < lead(backward) else "backward"


def _schedule(
    forward: list[fx.Node], backward: list[fx.Node], costs: CostModel, sequence: list[fx.Node] | None
) -> list[fx.Node]:
    """List-schedule both halves (see the module docstring); ``sequence`` fixes the order of all collectives."""
    half = _halves(forward, backward)
    position = {n: i for i, n in enumerate(forward)} | {n: i for i, n in enumerate(backward)}
    preds: dict[fx.Node, set[fx.Node]] = {n: {i for i in n.all_input_nodes if i in half} for n in half}
    for nodes in (forward, backward):
        chain = [n for n in nodes if _ordered(n)]
        for before, after in itertools.pairwise(chain):
            preds[after].add(before)
    for before, after in itertools.pairwise(sequence or []):
        preds[after].add(before)
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in half}
    for node, parents in preds.items():
        for parent in parents:
            users[parent].append(node)
    missing = {n: len(p) for n, p in preds.items()}
    ready = {n for n, count in missing.items() if count == 0}
    current = _first_half(forward, backward)
    now = channel = 0.0
    finish: dict[fx.Node, float] = {}
    order: list[fx.Node] = []

    def take(node: fx.Node) -> None:
        ready.discard(node)
        order.append(node)
        for user in users[node]:
            missing[user] -= 1
            if missing[user] == 0:
                ready.add(user)

    def first(nodes: list[fx.Node]) -> fx.Node:
        return min(nodes, key=lambda n: (position[n], half[n]))

    while ready:
        comms = [n for n in ready if _kind(n) == "comm"]
        if comms:
            node = first(comms)
            start = max(now, channel)
            channel = finish[node] = start + max(0.0, costs.comm_us(node))
            take(node)
            continue
        compute = [n for n in ready if _kind(n) == "compute" and half[n] == current]
        if compute:
            node = first(compute)
            now += max(0.0, costs.compute_us(node))
            take(node)
            continue
        waits = [n for n in ready if half[n] == current]
        done = [w for w in waits if finish.get(_issued_by(w) or w, 0.0) <= now]
        if done:
            take(first(done))
            continue
        other: Half = "backward" if current == "forward" else "forward"
        if any(half[n] == other for n in ready if _kind(n) == "compute" or finish.get(_issued_by(n) or n, 0.0) <= now):
            current = other
            continue
        node = min(ready, key=lambda n: (finish.get(_issued_by(n) or n, 0.0), position[n], half[n]))
        now = max(now, finish.get(_issued_by(node) or node, 0.0))
        current = half[node]
        take(node)
    if len(order) != len(half):
        raise AssertionError("the multiplex scheduler left nodes unscheduled: the dependency graph has a cycle")
    return order


def _report(
    order: list[fx.Node],
    names: dict[fx.Node, str],
    half: dict[fx.Node, Half],
    costs: CostModel,
    sequential: Simulation,
) -> OverlapReport:
    sim = simulate(order, costs)
    index = {n: i for i, n in enumerate(order)}
    rows = []
    for node in order:
        if _kind(node) != "comm":
            continue
        waits = [u for u in node.users if is_wait(u)]
        end = min((index[w] for w in waits), default=index[node])
        between = [n for n in order[index[node] + 1 : end] if _kind(n) == "compute"]
        start, stop, stall = sim.comms[node]
        rows.append(
            CommOverlap(
                issue=names[node],
                wait=names[order[end]] if waits else "",
                kind=COLLECTIVE_KINDS.get(str(getattr(packet(node), "__name__", "")), "collective"),
                half=half[node],
                compute_between=tuple(names[n] for n in between),
                other_half_between=sum(half[n] != half[node] for n in between),
                compute_between_us=sum(max(0.0, costs.compute_us(n)) for n in between),
                comm_us=stop - start,
                start_us=start,
                finish_us=stop,
                exposed_us=stall,
            )
        )
    return OverlapReport(comms=tuple(rows), multiplexed=sim, sequential=sequential)


def _attribute(module: torch.nn.Module, target: str) -> object:
    value: object = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def multiplex(
    forward: fx.GraphModule, backward: fx.GraphModule, *, costs: CostModel, overlap: bool = True
) -> Multiplexed:
    """Merge ``forward`` and ``backward`` into one graph ordered for overlap (pure: the inputs are untouched).

    ``costs`` prices the nodes of ``forward`` and ``backward``. With
    ``overlap=False`` the merged graph runs F then B in their own orders
    (the baseline, same calling convention).
    """
    fw_body, bw_body = _body(forward), _body(backward)
    half = _halves(fw_body, bw_body)
    sequential = simulate([*fw_body, *bw_body], costs)
    if overlap:
        # the collectives' order comes from shapes alone (the roofline), so it is the same on every rank
        # whatever each rank's cost estimates; the user's costs then place the compute around it
        plan = _schedule(fw_body, bw_body, roofline_costs(), None)
        order = _schedule(fw_body, bw_body, costs, [n for n in plan if _kind(n) == "comm"])
    else:
        order = [*fw_body, *bw_body]

    graph = fx.Graph()
    envs: dict[Half, dict[fx.Node, fx.Node]] = {"forward": {}, "backward": {}}
    counts = {}
    labelled: tuple[tuple[Half, fx.GraphModule], ...] = (("forward", forward), ("backward", backward))
    for label, gm in labelled:
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        counts[label] = len(holders)
        for node in holders:
            copy = graph.placeholder(f"{label[0]}_{node.name}")
            copy.meta = dict(node.meta)
            envs[label][node] = copy
    root = torch.nn.Module()
    names: dict[fx.Node, str] = {}
    for node in order:
        env = envs[half[node]]
        copy = graph.node_copy(node, lambda n, env=env: env[n])  # type: ignore[misc]
        if node.op == "get_attr":  # a constant of one half: keep it under a name of its own
            source = forward if half[node] == "forward" else backward
            copy.target = f"{half[node]}_{node.target}".replace(".", "_")
            setattr(root, str(copy.target), _attribute(source, str(node.target)))
        copy.meta[HALF_KEY] = half[node]
        env[node] = copy
        names[node] = copy.name
    outputs: list[fx.node.Argument] = []
    output_counts = {}
    for label, gm in labelled:
        result = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        values = list(result) if isinstance(result, (tuple, list)) else [result]
        output_counts[label] = len(values)
        outputs.extend(fx.map_arg(v, lambda n, env=envs[label]: env[n]) for v in values)  # type: ignore[misc]
    graph.output(tuple(outputs))
    graph.lint()
    merged = fx.GraphModule(root, graph)
    return Multiplexed(
        graph=merged,
        num_forward_inputs=counts["forward"],
        num_backward_inputs=counts["backward"],
        num_forward_outputs=output_counts["forward"],
        num_backward_outputs=output_counts["backward"],
        report=_report(order, names, half, costs, sequential),
    )
