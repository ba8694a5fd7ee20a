"""The plan text format: a lossless, line-based, diffable form of a Plan.

Example::

    octopipe-plan v1
    name "1f1b-p2-m2"
    version 1
    model {"name": "llama-8", "source": "octopipe.examples:llama", "config": {}}
    microbatches 2
    label "schedule" "1f1b"
    stage 0 rank 0 ["embed", "layers.0"]
    stage 1 rank 1 ["layers.1", "head"]
    rank 0 cap 1073741824: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1

The ``mesh`` line is present exactly when the plan has a ``mesh`` (dp and ep
as stored, 0 included); ``tp T`` and ``cp C`` follow when set, ``sp`` with
sequence parallelism, and an explicit global rank map last:
``mesh dp 2 ep 1 tp 2 sp ranks [0, 2, 1, 3, 4, 6, 5, 7]``. The ``precision`` line (``precision
"bfloat16"``) is present exactly when the plan has a ``precision``.

Strings are JSON (ASCII-escaped), so any name survives a round trip.
Actions use the torch.distributed.pipelining text form.
"""

from __future__ import annotations

import json
import re
from typing import Final

from google.protobuf import json_format

from octopipe.ir.actions import action_from_proto, action_to_proto, format_action, parse_action
from octopipe.ir.plan import PlanError, validate_plan
from octopipe.plan.v1 import plan_pb2

__all__ = ["HEADER", "plan_from_text", "plan_to_text"]

HEADER: Final = "octopipe-plan v1"
_STAGE_RE: Final = re.compile(r"stage (\d+) rank (\d+) (\[.*\])")
_RANK_RE: Final = re.compile(r"rank (\d+)(?: cap (\d+))?:(.*)")
_MESH_RE: Final = re.compile(r"mesh dp (\d+) ep (\d+)(?: tp (\d+))?(?: cp (\d+))?( sp)?(?: ranks (\[[\d, ]*\]))?")


def _quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=True)


def plan_to_text(plan: plan_pb2.Plan) -> str:
    """The text form of ``plan`` (every field, in a fixed order)."""
    lines = [HEADER, f"name {_quote(plan.name)}", f"version {plan.version}"]
    if plan.HasField("model"):
        model = json_format.MessageToDict(plan.model, preserving_proto_field_name=True)
        model.setdefault("name", "")
        model.setdefault("source", "")
        model.setdefault("config", {})
        lines.append("model " + json.dumps(model, ensure_ascii=True, sort_keys=True))
    lines.append(f"microbatches {plan.num_microbatches}")
    if plan.HasField("mesh"):
        ranks = f" ranks {json.dumps(list(plan.mesh.global_ranks))}" if plan.mesh.global_ranks else ""
        mesh = plan.mesh
        split = (f" tp {mesh.tp}" if mesh.tp else "") + (f" cp {mesh.cp}" if mesh.cp else "")
        split += " sp" if mesh.sequence_parallel else ""
        lines.append(f"mesh dp {mesh.dp} ep {mesh.ep}{split}{ranks}")
    if plan.HasField("precision"):
        lines.append(f"precision {_quote(plan.precision.compute_dtype)}")
    lines.extend(f"label {_quote(k)} {_quote(plan.labels[k])}" for k in sorted(plan.labels))
    for stage in plan.stages:
        names = json.dumps(list(stage.layer_names), ensure_ascii=True)
        lines.append(f"stage {stage.stage_index} rank {stage.rank} {names}")
    for program in plan.ranks:
        cap = f" cap {program.memory_cap_bytes}" if program.HasField("memory_cap_bytes") else ""
        actions = "".join(" " + format_action(action_from_proto(a)) for a in program.actions)
        lines.append(f"rank {program.rank}{cap}:{actions}")
    return "\n".join(lines) + "\n"


def plan_from_text(text: str, *, validate: bool = True) -> plan_pb2.Plan:
    """Parse the text form; raise PlanError naming the line that is wrong."""
    lines = [(n, line.strip()) for n, line in enumerate(text.split("\n"), start=1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines or lines[0][1] != HEADER:
        raise PlanError(f"not an octopipe plan: the first line must be {HEADER!r}")
    plan = plan_pb2.Plan()
    for number, line in lines[1:]:
        try:
            _parse_line(plan, line)
        except (ValueError, json.JSONDecodeError, json_format.ParseError) as exc:
            raise PlanError(f"line {number}: {line[:80]!r}: {exc}") from None
    if validate:
        validate_plan(plan)
    return plan


def _parse_line(plan: plan_pb2.Plan, line: str) -> None:
    key, _, rest = line.partition(" ")
    if key == "name":
        plan.name = _string(rest)
    elif key == "version":
        plan.version = int(rest)
    elif key == "microbatches":
        plan.num_microbatches = int(rest)
    elif key == "model":
        json_format.ParseDict(json.loads(rest), plan.model)
    elif key == "label":
        decoder = json.JSONDecoder()
        name, end = decoder.raw_decode(rest)
        plan.labels[name] = _string(rest[end:].strip())
    elif key == "mesh" and (match := _MESH_RE.fullmatch(line)):
        plan.mesh.SetInParent()
        plan.mesh.dp, plan.mesh.ep = int(match.group(1)), int(match.group(2))
        if match.group(3) is not None:
            plan.mesh.tp = int(match.group(3))
        if match.group(4) is not None:
            plan.mesh.cp = int(match.group(4))
        plan.mesh.sequence_parallel = match.group(5) is not None
        if match.group(6) is not None:
            plan.mesh.global_ranks.extend(json.loads(match.group(6)))
    elif key == "precision":
        plan.precision.SetInParent()
        plan.precision.compute_dtype = _string(rest)
    elif key == "stage" and (match := _STAGE_RE.fullmatch(line)):
        names = json.loads(match.group(3))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("layer names must be a JSON list of strings")
        plan.stages.add(stage_index=int(match.group(1)), rank=int(match.group(2)), layer_names=names)
    elif key == "rank" and (match := _RANK_RE.fullmatch(line)):
        program = plan.ranks.add(rank=int(match.group(1)))
        if match.group(2) is not None:
            program.memory_cap_bytes = int(match.group(2))
        for token in match.group(3).split():
            program.actions.append(action_to_proto(parse_action(token)))
    else:
        raise ValueError(
            "expected one of: name, version, model, microbatches, 'mesh dp D ep E [tp T] [cp C] [sp] [ranks [...]]', precision, label, "
            "'stage N rank R [layers]', 'rank R [cap BYTES]: actions'"
        )


def _string(text: str) -> str:
    value = json.loads(text)
    if not isinstance(value, str):
        raise ValueError(f"expected a JSON string, got {text!r}")
    return value
