"""docs/examples/plan_reader.js (Node.js, no packages) reads Plans written by Python and prints what Python does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from octopipe.execute.runtime import workload_reference
from octopipe.ir import action_from_proto, format_action, save_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import dualpipe_v, equal_partition, interleaved_1f1b, zb_h1

READER = Path(__file__).resolve().parents[2] / "docs" / "examples" / "plan_reader.js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None or not READER.exists(), reason="needs node and docs/examples")


def summary(plan: plan_pb2.Plan) -> str:
    """What plan_reader.js prints, from the Python side (docs/plan-format.md)."""
    lines = [
        f"plan {plan.name} version {plan.version}: {plan.num_microbatches} micro-batches, "
        f"{len(plan.stages)} stages on {len(plan.ranks)} ranks",
        f"model {plan.model.name} from {plan.model.source}",
    ]
    lines += [f"stage {s.stage_index} on rank {s.rank}: {' '.join(s.layer_names)}" for s in plan.stages]
    for rank in plan.ranks:
        cap = f"cap {rank.memory_cap_bytes} bytes" if rank.HasField("memory_cap_bytes") else "no cap"
        actions = " ".join(format_action(action_from_proto(a)) for a in rank.actions)
        lines.append(f"rank {rank.rank} ({cap}, {len(rank.actions)} actions): {actions}")
    if plan.HasField("mesh"):
        ranks = ", ".join(str(r) for r in plan.mesh.global_ranks)
        lines.append(f"mesh dp {plan.mesh.dp} ep {plan.mesh.ep} global ranks [{ranks}]")
    return "\n".join(lines) + "\n"


def _plans() -> list[plan_pb2.Plan]:
    names = ["embed", *[f"layers.{i}" for i in range(16)], "head"]
    tuned_like = zb_h1(2, 8, layer_names=equal_partition(names, 2))
    tuned_like.model.CopyFrom(workload_reference("nemotronh-16", tiny=True, sequence=16))
    tuned_like.version = 2**40 + 7  # a uint64 beyond 32 bits
    capped = interleaved_1f1b(2, 2, 4, layer_names=equal_partition(names, 4))
    for rank in capped.ranks:
        rank.memory_cap_bytes = 3 * 2**30 + rank.rank
    overlapped = dualpipe_v(2, 6, layer_names=equal_partition(names, 4))  # (0F3;3B1)OVERLAP_F_B sub-actions
    meshed = zb_h1(2, 4)
    meshed.mesh.dp, meshed.mesh.ep = 2, 2
    meshed.mesh.global_ranks.extend([0, 2, 1, 3])
    return [tuned_like, capped, overlapped, meshed]


@pytest.mark.parametrize("index", range(4))
def test_node_reader_prints_what_python_reads(tmp_path: Path, index: int) -> None:
    plan = _plans()[index]
    path = tmp_path / "plan.binpb"
    if plan.HasField("mesh"):
        path.write_bytes(plan.SerializeToString())  # the reader decodes; whether the mesh runs is not its business
    else:
        save_plan(plan, path)
    assert NODE is not None
    result = subprocess.run([NODE, str(READER), str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == summary(plan)
    if index == 2:
        assert "OVERLAP_F_B" in result.stdout


def test_node_reader_refuses_what_is_not_a_plan(tmp_path: Path) -> None:
    assert NODE is not None
    bad = tmp_path / "bad.binpb"
    bad.write_bytes(b"\x0a\xff\x01")  # field 1, length 255, then nothing
    result = subprocess.run([NODE, str(READER), str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"plan_reader: {bad} is not a binary Plan: field 1: length 255")
