"""The tuner's search over per-stage recomputation policies under a memory budget."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from octopipe.execute.cli import main
from octopipe.ir import recompute_of
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import CostModel, Link, load_plan, simulate
from octopipe.tune import TuneConfig, recompute_options, tune

LAYERS = 8
RANKS, MICROBATCHES = 4, 8


def recomputing_profile() -> profile_pb2.Profile:
    """Eight equal layers; ``layers`` keeps a tenth of the activations and re-runs F inside I."""
    profile = profile_pb2.Profile(device="test", microbatch_size=1)
    for index in range(LAYERS):
        layer = profile.layers.add(
            layer_name=f"layers.{index}",
            layer_type="test",
            forward_duration_us=10.0,
            backward_input_duration_us=10.0,
            backward_weight_duration_us=10.0,
            activation_saved_bytes=1000,
            activation_freed_by_backward_input_bytes=500,
            activation_freed_by_backward_weight_bytes=500,
            parameter_bytes=100,
        )
        layer.output_tensors.add(shape=[10], dtype="uint8", size_bytes=10)
        for label, saved, extra in (("layers", 100, 10.0), ("budget:0.5", 500, 4.0)):
            variant = layer.recomputed.add(
                recompute=label,
                forward_duration_us=10.0,
                backward_input_duration_us=10.0 + extra,
                backward_weight_duration_us=10.0,
                activation_saved_bytes=saved,
                activation_freed_by_backward_input_bytes=saved // 2,
                activation_freed_by_backward_weight_bytes=saved - saved // 2,
            )
            variant.layer_name = layer.layer_name
    return profile


def one_f_one_b_peak(profile: profile_pb2.Profile) -> int:
    result = tune(profile, TuneConfig(num_ranks=RANKS, num_microbatches=MICROBATCHES, default_link=Link()))
    return max(result.memory_caps.values())


def verified(result, profile: profile_pb2.Profile):  # type: ignore[no-untyped-def]
    """The plan as the verifier costs it, from its own Stage.recompute fields."""
    return simulate(result.plan, CostModel.from_profile(result.plan, profile, default_link=Link())).estimate


def test_options_are_ordered_by_saved_bytes_and_checked() -> None:
    profile = recomputing_profile()
    assert recompute_options(profile) == ("none", "budget:0.5", "layers")
    assert recompute_options(profile, ("layers",)) == ("none", "layers")
    with pytest.raises(ValueError, match=r"not profiled with recompute policy 'budget:0.25'.*budget:0.5, layers"):
        recompute_options(profile, ("budget:0.25",))
    del profile.layers[3].recomputed[:]
    assert recompute_options(profile) == ("none",)  # only what every layer has


def test_a_budget_below_1f1b_is_met_by_recomputing_where_it_costs_least() -> None:
    profile = recomputing_profile()
    peak = one_f_one_b_peak(profile)
    for cap in (peak // 2, peak // 4):
        config = TuneConfig(num_ranks=RANKS, num_microbatches=MICROBATCHES, memory_cap_bytes=cap, default_link=Link())
        result = tune(profile, config)
        estimate = verified(result, profile)  # the plan's own Stage.recompute fields give the verifier's costs
        assert all(rank.peak_memory_bytes <= cap for rank in estimate.ranks)
        assert estimate.step_time_us == pytest.approx(result.estimate.step_time_us)
        labels = [recompute_of(stage).label for stage in result.plan.stages]
        assert any(label != "none" for label in labels), labels
        assert "recompute per stage" in result.description
        # no worse than 1F1B on equal layers with every layer recomputed, which fits both caps
        uniform = replace(config, recompute=("layers",), families=("linear",), list_scheduler=False)
        assert result.estimate.step_time_us <= tune(profile, uniform).estimate.step_time_us
        if cap == peak // 2:  # saving everything fits too, slower
            saving = tune(profile, replace(config, recompute=("none",)))
            assert result.estimate.step_time_us < saving.estimate.step_time_us
        else:  # saving everything fits no plan
            with pytest.raises(ValueError, match="no plan fits"):
                tune(profile, replace(config, recompute=("none",)))


def test_a_generous_budget_recomputes_nothing() -> None:
    profile = recomputing_profile()
    config = TuneConfig(num_ranks=RANKS, num_microbatches=MICROBATCHES, memory_cap_bytes=10**9, default_link=Link())
    result = tune(profile, config)
    assert [recompute_of(stage).label for stage in result.plan.stages] == ["none"] * len(result.plan.stages)
    assert "recompute" not in result.description


def test_an_unfittable_budget_names_the_smallest_peak_and_its_plan() -> None:
    profile = recomputing_profile()
    with pytest.raises(ValueError, match="no plan fits") as refused:
        tune(profile, TuneConfig(num_ranks=RANKS, num_microbatches=MICROBATCHES, memory_cap_bytes=50))
    message = str(refused.value)
    found = re.search(
        r"smallest peak the search reached is (\d+) bytes.*whose peak per rank is \[([\d, ]+)\] bytes, "
        r"(\d+) bytes over the caps in all; recomputation searched: none, budget:0.5, layers",
        message,
    )
    assert found is not None, message
    peaks = [int(x) for x in found.group(2).split(",")]
    assert int(found.group(1)) == max(peaks)
    assert int(found.group(3)) == sum(max(0, peak - 50) for peak in peaks)
    assert "recompute per stage [" in message  # the smallest peak recomputes


# --- octopipe tune: --memory-budget and --recompute ---


def tune_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(json_format.MessageToJson(recomputing_profile()))
    argv = ["tune", str(profile_path), "--ranks", str(RANKS), "--microbatches", str(MICROBATCHES), "--kicks", "0"]
    code = main([*argv, "--out", str(tmp_path / "tuned.binpb"), "--json", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else {}, captured.err.strip()


def test_cli_budget_from_the_device_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = tune_cli(tmp_path, capsys)
    assert code == 0
    assert "host memory shared by 4 local ranks" in report["memory_budget"] and "10% reserve" in report["memory_budget"]
    assert report["memory_cap_bytes"][0] > 10**6  # a host's share, not 1F1B's few kilobytes
    code, report, _ = tune_cli(tmp_path, capsys, "--memory-budget", "1f1b")
    assert code == 0 and report["memory_cap_bytes"][0] == max(report["baseline_1f1b_equal"]["peak_memory_bytes"])


def test_cli_searches_recompute_under_a_stated_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = one_f_one_b_peak(recomputing_profile()) // 4
    code, report, _ = tune_cli(tmp_path, capsys, "--memory-budget", str(cap))
    assert code == 0 and "recompute per stage" in report["description"]
    plan = load_plan(tmp_path / "tuned.binpb")
    assert any(recompute_of(stage).label != "none" for stage in plan.stages)
    code, _, error = tune_cli(tmp_path, capsys, "--memory-budget", str(cap), "--recompute", "none")
    assert code == 2 and "no plan fits" in error and len(error.splitlines()) == 1
    code, _, error = tune_cli(tmp_path, capsys, "--recompute", "budget:0.25")
    assert code == 2 and "not profiled with recompute policy 'budget:0.25'" in error
    code, _, error = tune_cli(tmp_path, capsys, "--memory-budget", "device", "--memory-reserve", "1.5")
    assert code == 2 and "reserve is a fraction" in error
