"""Action text and proto forms: torch-compatible, lossless, strict on bad input."""

from __future__ import annotations

import pytest
from hypothesis import given

from octopipe.ir import Action, ActionKind, action_from_proto, action_to_proto, format_action, parse_action
from octopipe.plan.v1 import plan_pb2
from tests.simulate.strategies import actions

A = ActionKind


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2F0", Action(A.FORWARD, 2, 0)),
        ("1I3", Action(A.BACKWARD_INPUT, 1, 3)),
        ("0W3", Action(A.BACKWARD_WEIGHT, 0, 3)),
        ("3B12", Action(A.FULL_BACKWARD, 3, 12)),
        ("0SEND_F1", Action(A.SEND_F, 0, 1)),
        ("4RECV_B7", Action(A.RECV_B, 4, 7)),
        ("1UNSHARD", Action(A.UNSHARD, 1)),
        ("1RESHARD", Action(A.RESHARD, 1)),
        ("10REDUCE_GRAD", Action(A.REDUCE_GRAD, 10)),
        (
            "(0F3;3B1)OVERLAP_F_B",
            Action(A.OVERLAP_F_B, sub_actions=(Action(A.FORWARD, 0, 3), Action(A.FULL_BACKWARD, 3, 1))),
        ),
        (" 2F0 ", Action(A.FORWARD, 2, 0)),
    ],
)
def test_parse_and_format(text: str, expected: Action) -> None:
    assert parse_action(text) == expected
    assert format_action(expected) == text.strip()
    assert str(expected) == text.strip()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected [stage][kind][micro-batch]"),
        ("F0", "expected [stage][kind][micro-batch]"),
        ("2X0", "expected [stage][kind][micro-batch]"),
        ("2F", "FORWARD needs a micro-batch"),
        ("0SEND_F", "SEND_F needs a micro-batch"),
        ("1UNSHARD0", "takes no micro-batch: write '1UNSHARD'"),
        ("(0F1)OVERLAP_F_B", "exactly two sub-actions"),
        ("(0B1;0F2)OVERLAP_F_B", "a forward then a full or input-gradient backward"),
        ("(0F1;0W2)OVERLAP_F_B", "a forward then a full or input-gradient backward"),
        ("(0F1;0B2)OVERLAP", "expected [stage][kind][micro-batch]"),
        ("-1F0", "expected [stage][kind][micro-batch]"),
    ],
)
def test_bad_text_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="invalid action") as info:
        parse_action(text)
    assert message in str(info.value)


def test_constructor_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="stage must be >= 0"):
        Action(A.FORWARD, -1, 0)
    with pytest.raises(ValueError, match="micro-batch must be >= 0"):
        Action(A.FORWARD, 0, -2)
    with pytest.raises(ValueError, match="only OVERLAP_F_B has sub-actions"):
        Action(A.FORWARD, 0, 0, sub_actions=(Action(A.FORWARD, 0, 0),))
    with pytest.raises(ValueError, match="carries no stage or micro-batch"):
        Action(A.OVERLAP_F_B, 1, sub_actions=(Action(A.FORWARD, 0, 0), Action(A.FULL_BACKWARD, 1, 0)))
    with pytest.raises(TypeError, match="must be an ActionKind"):
        Action("F", 0, 0)  # type: ignore[arg-type]


def test_unspecified_proto_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a valid ActionKind"):
        action_from_proto(plan_pb2.Action(stage_index=1, microbatch_index=0))
    with pytest.raises(ValueError, match="not a valid ActionKind"):
        action_from_proto(plan_pb2.Action(kind=99))  # type: ignore[arg-type]


def test_every_proto_kind_has_an_action_kind() -> None:
    names = {n.removeprefix("ACTION_KIND_") for n in plan_pb2.ActionKind.keys()} - {"UNSPECIFIED"}  # noqa: SIM118
    assert names == {k.name for k in ActionKind}
    for kind in ActionKind:
        assert ActionKind.from_proto(kind.proto) is kind


def test_matches_torch_action_text() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    texts = [
        "2F0",
        "1I3",
        "0W3",
        "3B1",
        "0SEND_F1",
        "1RECV_F2",
        "2SEND_B0",
        "0RECV_B4",
        "1UNSHARD",
        "0RESHARD",
        "2REDUCE_GRAD",
        "(0F3;3B1)OVERLAP_F_B",
    ]
    for text in texts:
        theirs = schedules._Action.from_str(text)
        ours = parse_action(text)
        assert str(theirs) == format_action(ours) == text
        parts = theirs.sub_actions or (theirs,)
        for their_part, our_part in zip(parts, ours.computations, strict=True):
            assert their_part.stage_index == our_part.stage
            assert their_part.microbatch_index == our_part.microbatch
            assert their_part.computation_type.value == our_part.kind.code


@given(actions())
def test_text_round_trip(action: Action) -> None:
    assert parse_action(format_action(action)) == action


@given(actions())
def test_proto_round_trip(action: Action) -> None:
    message = action_to_proto(action)
    assert action_from_proto(message) == action
    assert action_from_proto(plan_pb2.Action.FromString(message.SerializeToString())) == action
