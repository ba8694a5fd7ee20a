"""Actions: one step of a rank's program, with the torch-compatible text form.

The text form is torch.distributed.pipelining's: ``[stage][kind][micro-batch]``
(``2F0``, ``1I3``, ``0W3``, ``0SEND_F1``, ``1UNSHARD``) and, for an overlapped
forward/backward pair, ``(0F3;3B1)OVERLAP_F_B``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from octopipe.plan.v1 import plan_pb2

__all__ = [
    "Action",
    "ActionKind",
    "action_from_proto",
    "action_to_proto",
    "format_action",
    "parse_action",
]


class ActionKind(enum.Enum):
    """What an action does; the value is its text code."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    FULL_BACKWARD = "B"
    OVERLAP_F_B = "OVERLAP_F_B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    @property
    def code(self) -> str:
        """The text code, e.g. ``F`` or ``SEND_B``."""
        return self.value

    @property
    def proto(self) -> plan_pb2.ActionKind.ValueType:
        """The matching ``octopipe.plan.v1.ActionKind`` value."""
        return plan_pb2.ActionKind.Value(f"ACTION_KIND_{self.name}")

    @classmethod
    def from_proto(cls, value: int) -> ActionKind:
        """The kind for an ``octopipe.plan.v1.ActionKind`` value."""
        found = _BY_PROTO.get(value)
        if found is None:
            raise ValueError(
                f"action kind {value} is not a valid ActionKind: set `kind` to one of "
                "ACTION_KIND_FORWARD .. ACTION_KIND_REDUCE_GRAD"
            )
        return found

    @property
    def is_compute(self) -> bool:
        """F, I, W, B and OVERLAP_F_B run on the compute stream."""
        return self in _COMPUTE

    @property
    def is_p2p(self) -> bool:
        """SEND_F, RECV_F, SEND_B and RECV_B move tensors between stages."""
        return self in _P2P

    @property
    def is_collective(self) -> bool:
        """UNSHARD, RESHARD and REDUCE_GRAD act on a whole stage's parameters."""
        return self in _STAGE_WIDE

    @property
    def has_microbatch(self) -> bool:
        """Whether actions of this kind name a micro-batch."""
        return self not in _STAGE_WIDE and self is not ActionKind.OVERLAP_F_B


# proto value -> kind (read-only; every kind but ACTION_KIND_UNSPECIFIED)
_BY_PROTO: Final[Mapping[int, ActionKind]] = MappingProxyType({kind.proto: kind for kind in ActionKind})
_COMPUTE: Final = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
        ActionKind.FULL_BACKWARD,
        ActionKind.OVERLAP_F_B,
    }
)
_P2P: Final = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_STAGE_WIDE: Final = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})
_OVERLAP_BACKWARDS: Final = frozenset({ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT})

# Longest codes first so that `SEND_F` is not read as `S` + garbage.
_SIMPLE_RE: Final = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|I|B|W)(\d*)")
_OVERLAP_RE: Final = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
_FORM: Final = (
    "expected [stage][kind][micro-batch] such as '2F0', '1I3', '0SEND_F1', '1UNSHARD' or '(0F3;3B1)OVERLAP_F_B'"
)


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a rank's program.

    ``stage`` and ``microbatch`` are ignored by (and must be 0 and None for)
    OVERLAP_F_B, whose ``sub_actions`` are a forward and then a full or
    input-gradient backward.
    """

    kind: ActionKind
    stage: int = 0
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise TypeError(f"Action.kind must be an ActionKind, got {self.kind!r}")
        if self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if self.microbatch is not None and self.microbatch < 0:
            raise ValueError(f"micro-batch must be >= 0, got {self.microbatch}")
        if self.kind is ActionKind.OVERLAP_F_B:
            self._check_overlap()
            return
        if self.sub_actions:
            raise ValueError(f"only OVERLAP_F_B has sub-actions, not {self.kind.name}")
        if self.kind.has_microbatch and self.microbatch is None:
            raise ValueError(f"{self.kind.name} needs a micro-batch, e.g. '{self.stage}{self.kind.code}0'")
        if not self.kind.has_microbatch and self.microbatch is not None:
            raise ValueError(
                f"{self.kind.name} acts on the whole stage and takes no micro-batch: "
                f"write '{self.stage}{self.kind.code}'"
            )

    def _check_overlap(self) -> None:
        if self.stage != 0 or self.microbatch is not None:
            raise ValueError("OVERLAP_F_B carries no stage or micro-batch of its own: put them on its sub-actions")
        kinds = tuple(a.kind for a in self.sub_actions)
        if len(kinds) != 2 or kinds[0] is not ActionKind.FORWARD or kinds[1] not in _OVERLAP_BACKWARDS:
            raise ValueError(
                "OVERLAP_F_B needs exactly two sub-actions, a forward then a full or "
                f"input-gradient backward, e.g. '(0F3;3B1)OVERLAP_F_B'; got {kinds_text(kinds)}"
            )

    def __str__(self) -> str:
        return format_action(self)

    @property
    def computations(self) -> tuple[Action, ...]:
        """The plain actions this action runs: its sub-actions, or itself."""
        return self.sub_actions if self.kind is ActionKind.OVERLAP_F_B else (self,)


def kinds_text(kinds: tuple[ActionKind, ...]) -> str:
    return "(" + ", ".join(k.name for k in kinds) + ")"


def format_action(action: Action) -> str:
    """The torch-compatible text of ``action``, e.g. ``2F0`` or ``(0F3;3B1)OVERLAP_F_B``."""
    if action.kind is ActionKind.OVERLAP_F_B:
        return "(" + ";".join(format_action(a) for a in action.sub_actions) + ")OVERLAP_F_B"
    mb = "" if action.microbatch is None else str(action.microbatch)
    return f"{action.stage}{action.kind.code}{mb}"


def parse_action(text: str) -> Action:
    """Parse the torch-compatible text of one action.

    Raises ``ValueError`` naming the text and the expected form.
    """
    stripped = text.strip()
    try:
        if match := _OVERLAP_RE.fullmatch(stripped):
            subs = tuple(parse_action(part) for part in match.group(1).split(";"))
            return Action(ActionKind.OVERLAP_F_B, sub_actions=subs)
        if match := _SIMPLE_RE.fullmatch(stripped):
            stage, code, microbatch = match.groups()
            return Action(ActionKind(code), int(stage), int(microbatch) if microbatch else None)
    except ValueError as exc:
        raise ValueError(f"invalid action {text!r}: {exc}") from None
    raise ValueError(f"invalid action {text!r}: {_FORM}")


def action_to_proto(action: Action) -> plan_pb2.Action:
    """The ``octopipe.plan.v1.Action`` message for ``action``."""
    message = plan_pb2.Action(kind=action.kind.proto, stage_index=action.stage)
    if action.microbatch is not None:
        message.microbatch_index = action.microbatch
    message.sub_actions.extend(action_to_proto(a) for a in action.sub_actions)
    return message


def action_from_proto(message: plan_pb2.Action) -> Action:
    """The action an ``octopipe.plan.v1.Action`` message describes (validated)."""
    microbatch = message.microbatch_index if message.HasField("microbatch_index") else None
    return Action(
        ActionKind.from_proto(message.kind),
        message.stage_index,
        microbatch,
        tuple(action_from_proto(a) for a in message.sub_actions),
    )
