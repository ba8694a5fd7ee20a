"""The lock-step profiler: one pinned process per rank, samples started together, one merged Profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format

from octopipe.execute.cli import EXIT_OK, EXIT_USAGE, main
from octopipe.execute.runtime import workload_reference
from octopipe.execute.runtime.lockstep import LOCKSTEP_TIMED_FIELDS, merge_lockstep, profile_in_lockstep
from octopipe.execute.runtime.pinning import online_cpus
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.profile.v1 import profile_pb2


def _profile(names: list[str], forward: list[float], weight: float) -> profile_pb2.Profile:
    profile = profile_pb2.Profile()
    for name, f in zip(names, forward, strict=True):
        profile.layers.add(
            layer_name=name,
            forward_duration_us=f,
            backward_input_duration_us=2 * f,
            backward_weight_duration_us=weight,
            parameter_bytes=64,
        )
    return profile


def test_merge_takes_the_median_of_every_timed_field_and_keeps_the_rest() -> None:
    profiles = [_profile(["a", "b"], [10.0, 1.0], 5.0), _profile(["a", "b"], [30.0, 3.0], 9.0)]
    profiles.append(_profile(["a", "b"], [20.0, 100.0], 7.0))
    merged = merge_lockstep(profiles)
    assert [layer.forward_duration_us for layer in merged.layers] == [20.0, 3.0]
    assert [layer.backward_input_duration_us for layer in merged.layers] == [40.0, 6.0]
    assert [layer.backward_weight_duration_us for layer in merged.layers] == [7.0, 7.0]
    assert all(layer.parameter_bytes == 64 for layer in merged.layers)
    assert not any(layer.HasField("full_backward_duration_us") for layer in merged.layers)  # absent stays absent
    assert "full_backward_duration_us" in LOCKSTEP_TIMED_FIELDS


def test_merge_refuses_profiles_of_different_layers() -> None:
    with pytest.raises(ValueError, match="different layers"):
        merge_lockstep([_profile(["a", "b"], [1.0, 1.0], 1.0), _profile(["a", "c"], [1.0, 1.0], 1.0)])
    with pytest.raises(ValueError, match="no profiles"):
        merge_lockstep([])


def test_refuses_fewer_than_two_ranks_or_more_ranks_than_cores() -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=4)
    cores = len(online_cpus())
    with pytest.raises(ValueError, match=f"needs {cores + 1} online cores, this machine has {cores}"):
        profile_in_lockstep(reference, num_microbatches=4, num_ranks=cores + 1)
    with pytest.raises(ValueError, match="num_ranks >= 2"):
        profile_in_lockstep(reference, num_microbatches=4, num_ranks=1)


@pytest.mark.skipif(len(online_cpus()) < 2, reason="a lock-step profile needs 2 online cores")
def test_profiles_on_two_pinned_cores_with_the_sizes_a_profile_taken_alone_has() -> None:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=4)
    link = profile_pb2.LinkCost(latency_us=50.0, bandwidth_bytes_per_second=1e9)
    lockstep = profile_in_lockstep(reference, num_microbatches=4, num_ranks=2, link=link, repeats=2)
    alone = profile_reference(reference, num_microbatches=4, num_ranks=2, repeats=1)
    cores = online_cpus()
    assert lockstep.labels["core"] == f"{cores[0]},{cores[1]}"  # rank r on the core a local run gives rank r
    assert lockstep.labels["conditions"].startswith("lockstep: 2 processes pinned to cores")
    assert [(k.source_rank, k.destination_rank) for k in lockstep.links] == [(0, 1), (1, 0)]
    assert all(k.latency_us == 50.0 for k in lockstep.links)
    timed = ("forwardDurationUs", "backwardInputDurationUs", "backwardWeightDurationUs", "fullBackwardDurationUs")
    assert len(lockstep.layers) == len(alone.layers) > 0
    for mine, theirs in zip(lockstep.layers, alone.layers, strict=True):
        fields = [json_format.MessageToDict(cost) for cost in (mine, theirs)]
        for each in fields:
            assert all(each.pop(name) > 0 for name in timed if name in each)
        assert fields[0] == fields[1]  # only the times differ: every size, shape and byte count is the same


@pytest.mark.skipif(len(online_cpus()) < 2, reason="a lock-step profile needs 2 online cores")
def test_the_cli_profiles_in_lockstep_and_refuses_it_off_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    argv = ["profile", "--lockstep", "--workload", "llama-8", "--tiny", "--sequence", "8", "--repeats", "1"]
    assert main([*argv, "--out", str(out)]) == EXIT_OK
    profile = json_format.Parse(out.read_text(), profile_pb2.Profile())
    assert profile.model.name == "llama-8" and profile.model.config["tiny"] == "true"
    assert profile.labels["conditions"].startswith("lockstep: 2 processes pinned to cores")
    assert [c.layer_name for c in profile.layers][:2] == ["embed", "layers.0"]
    assert f"written: {out}" in capsys.readouterr().out
    assert main([*argv, "--device", "cuda", "--out", str(out)]) == EXIT_USAGE
    assert "--lockstep profiles eager graphs on this machine's CPU cores" in capsys.readouterr().err
