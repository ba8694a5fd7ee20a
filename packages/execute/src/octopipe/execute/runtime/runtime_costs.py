"""The runtime's own costs measured by a dedicated micro-bench, not fitted to step times (issue 36).

The terms are ``octopipe.simulate.RuntimeCosts``'s. Each comes from the records of emulated runs
(``RunOptions(emulate=...)``: the one interpreter, its channels and real gloo messages, computations that
wait for their profiled time instead of computing), read as follows:

* **dispatch per kind**: the program's time around an action that is neither the action's work nor a wait
  for its inputs: from the previous action's end to this action's start, less the time it waited for what
  it consumes (``ActionRecord.wait_ns``, which also holds the few microseconds of the pre-action checks;
  for actions that consumed no transfer all of it is the interpreter's). For SEND and RECV the record's own
  span (handing the tensors to the channel thread, allocating the receive buffers) is posting work too.
  The median per kind over every step after the warm-up.
* **CPU work per message**: in a plan where every consumer has nothing else to do (1F1B, p = 2, m = 1: one
  message each way, each awaited), a message's time from its SEND's end to the end of the consumer's wait,
  less what the probed link takes for its bytes, is the work of the two channel threads on it. The medians
  at several sizes give ``fixed + bytes x per MiB`` by least squares; it is put on the receiving end
  (``recv_cpu``: the message is delivered when the receiving thread has taken it; the split between the two
  ends is not observable from the pair, and only their sum lies on the message's path).
* **the threads' share of the core**: not fitted. It is a fact of the placement: a rank pinned to one core
  runs its channel threads on that core (1), a rank whose messages are copied by a GPU's engines or run
  on cores of their own does not (0); ``measure_runtime_costs(thread_share=...)`` states it.

Each term is held within its physical bounds (``octopipe.simulate.runtime_costs.BOUNDS``) and reported with
them; a term held at a bound says so (``FittedTerm.clamped``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from octopipe.execute.runs import RunOptions, RunResult
from octopipe.execute.runtime.launcher import run_local_many
from octopipe.ir import ActionKind, parse_action
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import BOUNDS, DISPATCHED_KINDS, FittedTerm, Link, MessageCpu, RuntimeCosts, uniform_profile
from octopipe.tune import DEFAULT_SCHEDULES, one_f_one_b

__all__ = ["RuntimeCostMeasurement", "dispatch_samples", "measure_runtime_costs", "message_samples"]

_MIB = float(1 << 20)
_P2P = {ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B}
_SENDS = {ActionKind.SEND_F, ActionKind.SEND_B}


@dataclass(frozen=True)
class RuntimeCostMeasurement:
    """What ``measure_runtime_costs`` found: the terms, each fit with its bounds, and the samples behind them."""

    runtime: RuntimeCosts
    fitted: tuple[FittedTerm, ...]
    #: kind (``F``, ``SEND_F``, ...) -> per-action dispatch samples, microseconds
    dispatch_us: dict[str, list[float]]
    #: message bytes -> per-message CPU samples (path less the probed link), microseconds
    message_us: dict[int, list[float]]
    link: Link

    def as_dict(self) -> dict[str, object]:
        return {
            "terms": [term.as_dict() for term in self.fitted],
            "dispatch_samples": {k: len(v) for k, v in self.dispatch_us.items()},
            "message_cpu_median_us": {str(b): statistics.median(v) for b, v in sorted(self.message_us.items())},
            "message_samples": {str(b): len(v) for b, v in sorted(self.message_us.items())},
            "link": {
                "latency_us": self.link.latency_us,
                "bandwidth_bytes_per_second": self.link.bandwidth_bytes_per_second,
            },
        }


#: a received boundary: (F: a forward's input, B: a backward's output gradient; stage; micro-batch)
_Received = tuple[str, int, int]


def _consumed(action: str) -> list[_Received]:
    """What a computation record consumes if its rank received it: each half's forward input (``F``) and
    backward output gradient (``B``), by stage and micro-batch; read from the record's action alone."""
    out: list[_Received] = []
    for part in parse_action(action).computations:
        direction = "F" if part.kind is ActionKind.FORWARD else "B"
        out.append((direction, part.stage or 0, part.microbatch or 0))
    return out


def _received(action: str) -> _Received | None:
    """The boundary a RECV record posts for, or a SEND record sends to (the receiving stage), else None."""
    parsed = parse_action(action)
    stage, microbatch = parsed.stage or 0, parsed.microbatch or 0
    if parsed.kind is ActionKind.RECV_F:
        return ("F", stage, microbatch)
    if parsed.kind is ActionKind.RECV_B:
        return ("B", stage, microbatch)
    if parsed.kind is ActionKind.SEND_F:
        return ("F", stage + 1, microbatch)
    if parsed.kind is ActionKind.SEND_B:
        return ("B", stage - 1, microbatch)
    return None


def dispatch_samples(result: RunResult, *, warmup: int = 1) -> dict[ActionKind, list[float]]:
    """Per kind, each action's dispatch in microseconds (see the module docstring), steps after ``warmup``.
    A computation consumed a message when its rank posted a RECV for one of its halves earlier in the step."""
    samples: dict[ActionKind, list[float]] = {}
    checks: list[float] = []  # the pre-action checks, as computations that consumed nothing took them
    waited: list[tuple[ActionKind, float]] = []
    for steps in result.timelines.values():
        for step in steps[warmup:]:
            previous = step.start_ns
            posted: set[_Received] = set()
            for record in step.records:
                kind = parse_action(record.action).kind
                around = (record.start_ns - previous - record.wait_ns) / 1e3
                previous = record.end_ns
                if kind in _P2P:  # posting: the record's own span is the program's work for it too
                    own = (record.end_ns - record.start_ns + record.wait_ns) / 1e3
                    samples.setdefault(kind, []).append(around + own)
                    boundary = _received(record.action)
                    if kind in (ActionKind.RECV_F, ActionKind.RECV_B) and boundary is not None:
                        posted.add(boundary)
                elif kind in DISPATCHED_KINDS and posted & set(_consumed(record.action)):
                    waited.append((kind, around))
                elif kind in DISPATCHED_KINDS:
                    checks.append(record.wait_ns / 1e3)
                    samples.setdefault(kind, []).append(around + record.wait_ns / 1e3)
    idle = statistics.median(checks) if checks else 0.0
    for kind, around in waited:  # its wait held the checks too: count them as an idle computation took them
        samples.setdefault(kind, []).append(around + idle)
    return samples


def message_samples(result: RunResult, *, warmup: int = 1) -> list[float]:
    """Per message whose consumer waited for it: from its SEND record's end (posted) to its consumer's start
    (the wait over), microseconds. In a strictly alternating plan every consumer waits."""
    sent: dict[tuple[int, _Received], int] = {}  # (step, boundary) -> the SEND's end
    arrived: dict[tuple[int, _Received], int] = {}  # (step, boundary) -> the consumer's start
    for steps in result.timelines.values():
        for step in steps[warmup:]:
            posted: set[_Received] = set()
            for record in step.records:
                kind = parse_action(record.action).kind
                boundary = _received(record.action)
                if kind in (ActionKind.SEND_F, ActionKind.SEND_B) and boundary is not None:
                    sent[(step.step, boundary)] = record.end_ns
                elif boundary is not None:
                    posted.add(boundary)
                elif kind in DISPATCHED_KINDS and record.wait_ns:
                    for consumed in set(_consumed(record.action)) & posted:
                        posted.discard(consumed)
                        arrived[(step.step, consumed)] = record.start_ns
    return [(arrived[key] - end) / 1e3 for key, end in sent.items() if key in arrived]


def _plan(schedule: str) -> plan_pb2.Plan:
    if schedule == "ping":
        plan = one_f_one_b(2, 1, layer_names=[["l0"], ["l1"]])
        plan.name = "ping-p2-m1"
        return plan
    return DEFAULT_SCHEDULES.entry(schedule).generate(2, 4, layer_names=[["l0"], ["l1"], ["l2"], ["l3"]])


def measure_runtime_costs(
    link: Link,
    *,
    sizes: Sequence[int] = (64, 1 << 20, 4 << 20),
    steps: int = 12,
    warmup: int = 2,
    compute_us: float = 2000.0,
    thread_share: float = 1.0,
    timeout_s: float = 300.0,
) -> RuntimeCostMeasurement:
    """Run the micro-bench on two local emulated ranks and fit every term (see the module docstring).

    ``link``: the probed link (``linkprobe.measure_link``), whose time is taken off each message.
    ``sizes``: message bytes for the per-message fit; ``compute_us``: each emulated computation's time
    (long enough that a rank's messages never queue behind each other on their channel)."""
    if steps <= warmup or warmup < 1:
        raise ValueError(f"give warmup >= 1 and steps above it, got steps={steps}, warmup={warmup}")
    plans, profiles = [], []
    for size in sizes:  # the alternating ping at every size, then DualPipeV for the kinds it adds (I, W, overlap)
        plans.append(_plan("ping"))
        profiles.append(_profile(size, compute_us, link))
    plans.append(_plan("dualpipe-v"))
    profiles.append(_profile(sizes[0], compute_us, link))
    dispatch: dict[ActionKind, list[float]] = {}
    messages: dict[int, list[float]] = {}
    for index, (plan, profile) in enumerate(zip(plans, profiles, strict=True)):
        options = RunOptions(steps=steps, timeout_s=timeout_s, emulate=profile)
        (result,) = run_local_many([plan], options)
        for kind, values in dispatch_samples(result, warmup=warmup).items():
            dispatch.setdefault(kind, []).extend(values)
        if index < len(sizes):
            size = sizes[index]
            transfer = link.transfer_us(size)
            messages[size] = [value - transfer for value in message_samples(result, warmup=warmup)]
    return _fit(dispatch, messages, link, thread_share)


def _profile(size: int, compute_us: float, link: Link) -> profile_pb2.Profile:
    return uniform_profile(
        ["l0", "l1", "l2", "l3"],
        num_ranks=2,
        forward_us=compute_us,
        backward_input_us=compute_us / 2,
        backward_weight_us=compute_us / 2,
        output_bytes=size,
        latency_us=link.latency_us,
        bandwidth_bytes_per_second=link.bandwidth_bytes_per_second,
    )


def _bounded(name: str, value: float, bounds: tuple[float, float]) -> FittedTerm:
    low, high = bounds
    held = min(max(value, low), high)
    return FittedTerm(name, held, low, high, clamped=held != value)


def _fit(
    dispatch: dict[ActionKind, list[float]], messages: dict[int, list[float]], link: Link, thread_share: float
) -> RuntimeCostMeasurement:
    fitted = []
    dispatch_us = {}
    for kind in DISPATCHED_KINDS:
        if dispatch.get(kind):
            term = _bounded(f"dispatch_us.{kind.value}", statistics.median(dispatch[kind]), BOUNDS["dispatch_us"])
            fitted.append(term)
            dispatch_us[kind] = term.value
    points = [(size, statistics.median(values)) for size, values in sorted(messages.items()) if values]
    slope, intercept = _least_squares(points)
    fixed = _bounded("recv_cpu.fixed_us", intercept, BOUNDS["message_fixed_us"])
    per_mib = _bounded("recv_cpu.us_per_mib", slope * _MIB, BOUNDS["message_us_per_mib"])
    fitted += [fixed, per_mib, FittedTerm("thread_share", thread_share, *BOUNDS["thread_share"])]
    runtime = RuntimeCosts(
        dispatch_us=dispatch_us,
        recv_cpu=MessageCpu(fixed_us=fixed.value, us_per_mib=per_mib.value),
        thread_share=thread_share,
    )
    return RuntimeCostMeasurement(
        runtime=runtime,
        fitted=tuple(fitted),
        dispatch_us={kind.value: values for kind, values in dispatch.items()},
        message_us=messages,
        link=link,
    )


def _least_squares(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(slope per byte, intercept) of the line through ``points``; one point: a flat line through it."""
    if not points:
        return 0.0, 0.0
    if len(points) == 1:
        return 0.0, points[0][1]
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return slope, mean_y - slope * mean_x
