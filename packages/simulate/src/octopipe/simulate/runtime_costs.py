"""The runtime's own costs: named terms of the cost model, each within physical bounds stated here.

A plan's step is not only its computations and its link. The runtime that runs it spends time of
its own, and the simulator, the verifier, both tuner paths and retune read the same terms from
:class:`RuntimeCosts` (``CostModel.runtime``):

* ``dispatch_us[kind]``: per action, the interpreter's time outside the action's own work (looking
  the action up, its bookkeeping, handing buffers over), per kind. It delays the rank's program:
  a compute action takes its work plus its dispatch; a SEND or RECV is posted after its dispatch.
* ``send_cpu`` / ``recv_cpu`` (:class:`MessageCpu`: fixed microseconds plus microseconds per MiB):
  the CPU work of one message on the sending and on the receiving rank (the channel thread's hand-off
  and copies into and out of the transport). It lies on the message's path: a transfer takes
  ``send_cpu + link + recv_cpu``.
* ``thread_share``: the part of that per-message CPU work that comes out of the rank's own compute
  core (1: the channel thread shares the core with compute, as CPU ranks pinned to one core each do;
  0: it runs on a core of its own, or on a GPU's copy engine). The simulator charges it to the
  rank's program where the message is posted.

Link latency and bandwidth are not here: they come from the link probe alone
(``profile.v1.LinkCost``). ``RuntimeCosts()`` (every term 0) is the model without runtime costs, the
default, so costs built before these terms time plans exactly as before.

The bounds (``BOUNDS``) are physical, not statistical: a dispatch longer than 5 ms or a per-message
fixed cost above 5 ms would be a runtime bug, not a cost to model; a per-MiB cost above 2000 us means
a copy slower than 0.5 GB/s, below any memory system a rank runs on. A fit (the micro-bench,
``octopipe.execute.runtime.runtime_costs``; calibration, ``octopipe.simulate.calibrate``) may only move a
term within them and reports each term with its bounds (:class:`FittedTerm`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from octopipe.ir.actions import ActionKind
from octopipe.profile.v1 import profile_pb2

__all__ = ["BOUNDS", "DISPATCHED_KINDS", "FittedTerm", "MessageCpu", "RuntimeCosts"]

#: the kinds that pass through the interpreter on the rank's program (collectives run on their own stream)
DISPATCHED_KINDS = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
    ActionKind.FULL_BACKWARD,
    ActionKind.OVERLAP_F_B,
    ActionKind.SEND_F,
    ActionKind.RECV_F,
    ActionKind.SEND_B,
    ActionKind.RECV_B,
)
#: each term's physical bounds, (low, high), in its own unit (see the module docstring)
BOUNDS: Mapping[str, tuple[float, float]] = {
    "dispatch_us": (0.0, 5000.0),
    "message_fixed_us": (0.0, 5000.0),
    "message_us_per_mib": (0.0, 2000.0),
    "thread_share": (0.0, 1.0),
}
_MIB = float(1 << 20)


def _check(name: str, value: float, what: str) -> None:
    low, high = BOUNDS[name]
    if not (low <= value <= high) or math.isnan(value):
        raise ValueError(f"{what} must be within its physical bounds [{low:g}, {high:g}], got {value}")


@dataclass(kw_only=True, frozen=True, slots=True)
class MessageCpu:
    """The CPU work one message costs one end: ``fixed_us + bytes / MiB * us_per_mib``."""

    fixed_us: float = 0.0
    us_per_mib: float = 0.0

    def __post_init__(self) -> None:
        _check("message_fixed_us", self.fixed_us, "MessageCpu.fixed_us")
        _check("message_us_per_mib", self.us_per_mib, "MessageCpu.us_per_mib")

    def us(self, num_bytes: int) -> float:
        """Microseconds of CPU work for a message of ``num_bytes``."""
        return self.fixed_us + num_bytes / _MIB * self.us_per_mib


@dataclass(kw_only=True, frozen=True)
class RuntimeCosts:
    """The runtime's per-action and per-message costs (see the module docstring). Every term 0 by default."""

    dispatch_us: Mapping[ActionKind, float] = field(default_factory=dict)
    send_cpu: MessageCpu = field(default_factory=MessageCpu)
    recv_cpu: MessageCpu = field(default_factory=MessageCpu)
    thread_share: float = 0.0

    def __post_init__(self) -> None:
        for kind, value in self.dispatch_us.items():
            if kind not in DISPATCHED_KINDS:
                raise ValueError(
                    f"RuntimeCosts.dispatch_us[{kind.value}]: only {', '.join(k.value for k in DISPATCHED_KINDS)} "
                    "are dispatched on the rank's program (collectives run on their own stream)"
                )
            _check("dispatch_us", value, f"RuntimeCosts.dispatch_us[{kind.value}]")
        _check("thread_share", self.thread_share, "RuntimeCosts.thread_share")

    @property
    def is_zero(self) -> bool:
        """Whether every term is 0 (the model without runtime costs)."""
        return (
            not any(self.dispatch_us.values())
            and self.send_cpu == MessageCpu()
            and self.recv_cpu == MessageCpu()
            and self.thread_share == 0.0
        )

    def dispatch(self, kind: ActionKind) -> float:
        """The dispatch overhead of one action of ``kind`` (0 for kinds without one)."""
        return self.dispatch_us.get(kind, 0.0)

    def message_cpu_us(self, num_bytes: int) -> float:
        """Both ends' CPU work for one message, which lies on its path (added to the link's time)."""
        return self.send_cpu.us(num_bytes) + self.recv_cpu.us(num_bytes)

    def posting_us(self, kind: ActionKind, num_bytes: int) -> float:
        """What posting one SEND or RECV of ``num_bytes`` costs the rank's program: its dispatch plus the
        rank's share of its end's CPU work."""
        cpu = self.send_cpu if kind in (ActionKind.SEND_F, ActionKind.SEND_B) else self.recv_cpu
        return self.dispatch(kind) + self.thread_share * cpu.us(num_bytes)

    @classmethod
    def from_proto(cls, message: profile_pb2.RuntimeCost) -> RuntimeCosts:
        """From a profile's ``runtime`` message; a term outside its bounds is an error naming it."""
        try:
            return cls(
                dispatch_us={ActionKind.from_proto(d.kind): d.overhead_us for d in message.dispatch},
                send_cpu=MessageCpu(fixed_us=message.send.fixed_us, us_per_mib=message.send.us_per_mib),
                recv_cpu=MessageCpu(fixed_us=message.receive.fixed_us, us_per_mib=message.receive.us_per_mib),
                thread_share=message.thread_share,
            )
        except ValueError as exc:
            raise ValueError(f"profile runtime costs: {exc}") from None

    def to_proto(self, *, source: str = "") -> profile_pb2.RuntimeCost:
        """As a profile's ``runtime`` message."""
        message = profile_pb2.RuntimeCost(thread_share=self.thread_share, source=source)
        for kind in DISPATCHED_KINDS:
            if kind in self.dispatch_us:
                message.dispatch.add(kind=kind.proto, overhead_us=self.dispatch_us[kind])
        message.send.fixed_us, message.send.us_per_mib = self.send_cpu.fixed_us, self.send_cpu.us_per_mib
        message.receive.fixed_us, message.receive.us_per_mib = self.recv_cpu.fixed_us, self.recv_cpu.us_per_mib
        return message

    @classmethod
    def from_terms(cls, terms: Mapping[str, float]) -> RuntimeCosts:
        """From terms named as :meth:`terms` names them (a missing term is 0; an unknown name is an error)."""
        kinds = {f"dispatch_us.{kind.value}": kind for kind in DISPATCHED_KINDS}
        known = {*kinds, "send_cpu.fixed_us", "send_cpu.us_per_mib", "recv_cpu.fixed_us", "recv_cpu.us_per_mib"}
        unknown = sorted(set(terms) - known - {"thread_share"})
        if unknown:
            raise ValueError(f"unknown runtime cost terms {unknown}: the terms are {sorted(known | {'thread_share'})}")
        return cls(
            dispatch_us={kind: terms[name] for name, kind in kinds.items() if name in terms},
            send_cpu=MessageCpu(
                fixed_us=terms.get("send_cpu.fixed_us", 0.0), us_per_mib=terms.get("send_cpu.us_per_mib", 0.0)
            ),
            recv_cpu=MessageCpu(
                fixed_us=terms.get("recv_cpu.fixed_us", 0.0), us_per_mib=terms.get("recv_cpu.us_per_mib", 0.0)
            ),
            thread_share=terms.get("thread_share", 0.0),
        )

    def terms(self) -> dict[str, float]:
        """Every term by name (``dispatch_us.F``, ``send_cpu.fixed_us``, ...), for reports."""
        out = {f"dispatch_us.{kind.value}": self.dispatch(kind) for kind in DISPATCHED_KINDS}
        for end, cpu in (("send_cpu", self.send_cpu), ("recv_cpu", self.recv_cpu)):
            out[f"{end}.fixed_us"] = cpu.fixed_us
            out[f"{end}.us_per_mib"] = cpu.us_per_mib
        out["thread_share"] = self.thread_share
        return out


@dataclass(frozen=True, slots=True)
class FittedTerm:
    """One fitted term as a fit reports it: its value, its physical bounds, and whether the fit was held
    at a bound (the data asked for a value outside them)."""

    name: str
    value: float
    low: float
    high: float
    clamped: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "value": self.value, "bounds": [self.low, self.high], "clamped": self.clamped}
