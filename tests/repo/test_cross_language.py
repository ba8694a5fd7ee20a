"""Plans and profiles written by Python are read by another language's protobuf (buf, in Go), and back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message

from octopipe.ir import StageSpec, build_plan
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from tests.repo.layout import ROOT

# buf comes from the buf-bin wheel that scripts/setup.sh installs next to this interpreter.
BUF = Path(sys.executable).parent / "buf" if (Path(sys.executable).parent / "buf").exists() else shutil.which("buf")


def rich_plan() -> plan_pb2.Plan:
    plan = build_plan(
        stages=[
            StageSpec(rank=0, layer_names=("embed", "layers.0")),
            StageSpec(rank=1, layer_names=("layers.1",)),
            StageSpec(rank=0, layer_names=("head",)),
        ],
        actions={
            0: "0UNSHARD 0F0 0SEND_F0 2RECV_F0 (2F0;2B0)OVERLAP_F_B 2SEND_B0 0RECV_B0 0I0 0W0 0REDUCE_GRAD".split(),
            1: "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0".split(),
        },
        num_microbatches=1,
        name="v-shape \u00e9\u6f22",
        version=2**63 + 5,
        memory_caps={1: 80 * 2**30},
        labels={"schedule": "hand"},
    )
    plan.model.name = "jamba-8"
    plan.model.config["pattern"] = "MMMM*MMM"
    return plan


def rich_profile() -> profile_pb2.Profile:
    profile = profile_pb2.Profile(device="cpu", microbatch_size=4)
    layer = profile.layers.add(
        layer_name="layers.0", layer_type="mamba", forward_duration_us=12.5, backward_input_duration_us=9.25
    )
    layer.output_tensors.add(shape=[4, 128, 256], dtype="float32", size_bytes=4 * 128 * 256 * 4)
    layer.full_backward_duration_us = 20.0
    profile.links.add(source_rank=0, destination_rank=1, latency_us=100.0, bandwidth_bytes_per_second=3.5e9)
    timeline = profile.timelines.add(rank=1, step=3)
    record = timeline.records.add(stream="compute", start_us=1.0, end_us=2.5, memory_after_bytes=123)
    record.action.CopyFrom(rich_plan().ranks[0].actions[4])
    return profile


def buf_convert(type_name: str, source: Path, to: str) -> bytes:
    assert BUF is not None, "buf not found: run scripts/setup.sh (it installs buf-bin)"
    result = subprocess.run(
        [str(BUF), "convert", str(ROOT / "protos"), "--type", type_name, "--from", str(source), "--to", to],
        capture_output=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


@pytest.mark.parametrize(
    ("type_name", "message"),
    [("octopipe.plan.v1.Plan", rich_plan()), ("octopipe.profile.v1.Profile", rich_profile())],
)
def test_buf_decodes_what_python_wrote_and_back(type_name: str, message: Message, tmp_path: Path) -> None:
    binary = tmp_path / "message.binpb"
    binary.write_bytes(message.SerializeToString(deterministic=True))
    decoded = json.loads(buf_convert(type_name, binary, "-#format=json"))
    assert decoded == json_format.MessageToDict(message)
    # and the other way: buf encodes its JSON as binary, Python decodes the same message
    as_json = tmp_path / "message.json"
    as_json.write_text(json.dumps(decoded))
    encoded = buf_convert(type_name, as_json, "-#format=binpb")
    assert type(message).FromString(encoded) == message
