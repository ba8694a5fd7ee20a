"""Reading and writing plan files in every format the IR knows."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from octopipe.ir.plan import PlanError, validate_plan
from octopipe.ir.text import plan_from_text, plan_to_text
from octopipe.ir.torch_csv import plan_from_torch_csv, plan_to_torch_csv
from octopipe.plan.v1 import plan_pb2

__all__ = ["PlanFormat", "load_plan", "plan_format_for", "save_plan"]

PlanFormat = Literal["binary", "json", "text", "csv"]

_SUFFIXES: dict[str, PlanFormat] = {
    ".pb": "binary",
    ".binpb": "binary",
    ".json": "json",
    ".txt": "text",
    ".plan": "text",
    ".csv": "csv",
}


def plan_format_for(path: Path) -> PlanFormat:
    """The format a file's suffix names."""
    try:
        return _SUFFIXES[path.suffix.lower()]
    except KeyError:
        known = ", ".join(sorted(_SUFFIXES))
        raise PlanError(f"{path}: unknown plan file suffix {path.suffix!r}; use one of {known}") from None


def load_plan(path: Path, *, format: PlanFormat | None = None, num_microbatches: int | None = None) -> plan_pb2.Plan:
    """Read and validate a plan; raise PlanError saying what is wrong with the file.

    ``num_microbatches``: a torch CSV's micro-batch count (inferred when not
    given; see ``plan_from_torch_csv``); other formats carry their own and must
    agree with it.
    """
    kind = format or plan_format_for(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the plan file: {exc.strerror}") from None
    try:
        if kind == "binary":
            plan = plan_pb2.Plan.FromString(data)
        elif kind == "json":
            plan = json_format.Parse(data.decode("utf-8"), plan_pb2.Plan())
        elif kind == "text":
            plan = plan_from_text(data.decode("utf-8"))
        else:
            return plan_from_torch_csv(data.decode("utf-8"), name=path.stem, num_microbatches=num_microbatches)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    except (DecodeError, json_format.ParseError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: not a valid {kind} plan: {exc}") from None
    try:
        validate_plan(plan)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    if num_microbatches is not None and num_microbatches != plan.num_microbatches:
        raise PlanError(
            f"{path}: the plan has {plan.num_microbatches} micro-batches, not {num_microbatches}: "
            "drop --microbatches or give the plan's count"
        )
    return plan


def save_plan(plan: plan_pb2.Plan, path: Path, *, format: PlanFormat | None = None) -> None:
    """Write a plan; the suffix picks the format unless ``format`` is given."""
    kind = format or plan_format_for(path)
    if kind == "binary":
        path.write_bytes(plan.SerializeToString(deterministic=True))
    elif kind == "json":
        path.write_text(json_format.MessageToJson(plan, preserving_proto_field_name=True, sort_keys=True) + "\n")
    elif kind == "text":
        path.write_text(plan_to_text(plan))
    else:
        path.write_text(plan_to_torch_csv(plan))
