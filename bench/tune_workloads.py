"""The simulated workloads of shared/benchmarks.md as Profiles, from measured per-layer-type costs.

Source of the costs: `octopipe profile --workload jamba-8 | nemotronh-16 | llama-8 --repeats 3`
on the 2-core development machine (one thread, micro-batch 4 x 128 tokens, hidden 256, fp32), with
`--recompute layers budget:0.5`; per layer type the median over that type's layers is kept, for
saving everything and for each recomputation policy (its `recomputed` entries)
(bench/results/tune_layer_costs.json, rebuilt by `python bench/tune_workloads.py PROFILE...`).
No scaling: the large models are described at the measured hidden size 256 (their layer *patterns*
are what matters for partitioning; absolute times scale together). Links: the gloo figures of
shared/facts.md, 100 us latency and 3.5 GB/s, between every pair of ranks.

| workload | layers (plus embedding first, head + loss last) |
|---|---|
| nemotronh-8b | the 52-layer Nemotron-H 8B pattern: M = mamba2, * = attention, - = relu2 MLP |
| nemotronh-56b | the 118-layer 56B pattern |
| jamba-32 | 32 layers: mixer attention if i % 8 == 4 else Mamba; FFN MoE if i % 2 == 1 else SwiGLU |
| llama-32 | 32 Llama layers (attention + SwiGLU) |
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from octopipe.profile.v1 import profile_pb2

TABLE = Path(__file__).parent / "results" / "tune_layer_costs.json"
NEMOTRONH_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRONH_56B = (
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
    "M-M-M-M-M*-M-M-M-M-M-"
)
LATENCY_US = 100.0
BANDWIDTH = 3.5e9
WORKLOADS = ("nemotronh-8b", "nemotronh-56b", "jamba-32", "llama-32")
_FIELDS = (
    "forward_duration_us",
    "backward_input_duration_us",
    "backward_weight_duration_us",
    "activation_saved_bytes",
    "activation_freed_by_backward_input_bytes",
    "activation_freed_by_backward_weight_bytes",
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
)
#: what a recomputation policy changes (octopipe.simulate.RECOMPUTED_FIELDS, those the table keeps)
_RECOMPUTED = _FIELDS[:6]


def layer_types(name: str) -> list[str]:
    """The layer types of a workload, embedding first and head last."""
    if name == "nemotronh-8b":
        body = [{"M": "mamba2", "*": "attention", "-": "relu2"}[c] for c in NEMOTRONH_8B]
    elif name == "nemotronh-56b":
        body = [{"M": "mamba2", "*": "attention", "-": "relu2"}[c] for c in NEMOTRONH_56B]
    elif name == "jamba-32":
        body = [("attention" if i % 8 == 4 else "mamba") + ("+moe" if i % 2 == 1 else "+swiglu") for i in range(32)]
    elif name == "llama-32":
        body = ["attention+swiglu"] * 32
    else:
        raise ValueError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")
    return ["embedding", *body, "head"]


def build_table(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Median cost per layer type over the layers of the given Profiles (and per recomputation policy
    every layer of the type was profiled with, under ``recomputed``)."""
    samples: dict[str, list[profile_pb2.LayerCost]] = {}
    for path in paths:
        profile = json_format.Parse(path.read_text(), profile_pb2.Profile())
        for layer in profile.layers:
            samples.setdefault(layer.layer_type, []).append(layer)
    table: dict[str, dict[str, Any]] = {}
    for kind, layers in sorted(samples.items()):
        row: dict[str, Any] = {
            name: statistics.median(float(getattr(layer, name)) for layer in layers) for name in _FIELDS
        }
        row["output_bytes"] = statistics.median(
            float(sum(t.size_bytes for t in layer.output_tensors)) for layer in layers
        )
        row["samples"] = len(layers)
        policies = set.intersection(*({v.recompute for v in layer.recomputed} for layer in layers))
        row["recomputed"] = {
            policy: {
                name: statistics.median(
                    float(getattr(next(v for v in layer.recomputed if v.recompute == policy), name)) for layer in layers
                )
                for name in _RECOMPUTED
            }
            for policy in sorted(policies)
        }
        table[kind] = row
    return table


def _fill(layer: profile_pb2.LayerCost, row: dict[str, float], fields: tuple[str, ...]) -> None:
    """Set ``fields`` of ``layer`` from a table row, the activations freed split so they add up."""
    for field in fields:
        value = row[field]
        setattr(layer, field, value if field.endswith("_us") else int(value))
    saved = layer.activation_saved_bytes
    layer.activation_freed_by_backward_input_bytes = min(layer.activation_freed_by_backward_input_bytes, saved)
    layer.activation_freed_by_backward_weight_bytes = saved - layer.activation_freed_by_backward_input_bytes


def workload_profile(name: str, table: dict[str, dict[str, Any]] | None = None) -> profile_pb2.Profile:
    """The workload as a Profile (layers named `embed`, `layers.i`, `head`), links for 64 ranks."""
    costs = table if table is not None else json.loads(TABLE.read_text())["types"]
    profile = profile_pb2.Profile(
        device="cpu (per-type medians, bench/results/tune_layer_costs.json)", microbatch_size=4
    )
    profile.model.name = name
    types = layer_types(name)
    for index, kind in enumerate(types):
        row = costs[kind]
        layer_name = "embed" if index == 0 else "head" if index == len(types) - 1 else f"layers.{index - 1}"
        layer = profile.layers.add(layer_name=layer_name, layer_type=kind)
        _fill(layer, row, _FIELDS)
        for policy, costs_under in row.get("recomputed", {}).items():
            variant = layer.recomputed.add(layer_name=layer_name, layer_type=kind, recompute=policy)
            _fill(variant, costs_under, _RECOMPUTED)
        out = int(row["output_bytes"])
        if out:
            layer.output_tensors.add(shape=[out], dtype="uint8", size_bytes=out)
    for source in range(64):
        for destination in range(64):
            if source != destination:
                profile.links.add(
                    source_rank=source,
                    destination_rank=destination,
                    latency_us=LATENCY_US,
                    bandwidth_bytes_per_second=BANDWIDTH,
                )
    return profile


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv]
    table = build_table(paths)
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    source = (
        "octopipe profile --workload {jamba-8,nemotronh-16,llama-8} --repeats 3 --microbatch-size 4 --sequence 128 "
        "--recompute layers budget:0.5 (JSON), medians per layer type"
    )
    TABLE.write_text(json.dumps({"source": source, "files": [p.name for p in paths], "types": table}, indent=2) + "\n")
    print(f"{'type':18} {'policy':>10} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'saved MiB':>10} {'n':>3}")
    for kind, row in table.items():
        for policy, costs in [("none", row), *row["recomputed"].items()]:
            print(
                f"{kind:18} {policy:>10} {costs['forward_duration_us'] / 1e3:8.2f} "
                f"{costs['backward_input_duration_us'] / 1e3:8.2f} {costs['backward_weight_duration_us'] / 1e3:8.2f} "
                f"{costs['activation_saved_bytes'] / 2**20:10.1f} {int(row['samples']):3d}"
            )
    print(f"written: {TABLE}")


if __name__ == "__main__":
    main(sys.argv[1:])
