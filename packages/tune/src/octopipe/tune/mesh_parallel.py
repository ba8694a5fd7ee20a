"""Tensor- and context-parallel degrees for the mesh search, the bound that skips hopeless meshes, and
``scale_microbatches`` (the profile for bigger micro-batches).

Which (tp, cp) pairs ``tune_mesh`` tries (:func:`parallel_degrees`):

* tp: ``tp_degrees`` as given, else every divisor of the device count up to
  ``node_size`` (tp innermost: its all-reduces stay on one node's links) when
  the config names the model's sizes (``model_facts``), else only 1;
* cp: ``cp_degrees`` as given, else every divisor of ``model_facts["sequence"]``
  up to ``max_cp``, else only 1; always only 1 for a model with Mamba layers
  (its scan needs the whole sequence: what the runtime can run);
* each pair must divide the device count and pass
  ``octopipe.ir.check_mesh_model`` (tp divides the head counts and hidden
  units, cp divides the sequence).

(1, 1) comes first: the pp x dp search of before, unchanged. Every other mesh
is skipped when :func:`step_lower_bound_us` (the busiest rank works at least
the average and at least the heaviest layer, which no partition splits:
``m * max(sum / pp, max)`` over the layers' ``F + min(I + W, B)`` of one rank's
share, times ``1 - h / 2`` when OVERLAP_F_B units hide a fraction h of the
shorter half) is no shorter than the best step found within the cap; the
search visits them from the smallest bound up, so the bound prunes most.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octopipe.ir import MeshSpec, PlanError, check_mesh_model
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.tensor_parallel import MAMBA, components
from octopipe.tune.problem import Layers

__all__ = ["ParallelChoice", "has_mamba", "parallel_degrees", "scale_microbatches", "step_lower_bound_us"]

#: model_facts keys that tp must divide (any of them present: tp is searched)
TP_FACTS = ("heads", "mamba_heads", "ffn", "mlp_ffn")


@dataclass(kw_only=True, frozen=True)
class ParallelChoice:
    """The (tp, cp) pairs to try, (1, 1) first, and why other degrees were left out."""

    pairs: tuple[tuple[int, int], ...]
    excluded: tuple[str, ...] = ()


def has_mamba(profile: profile_pb2.Profile, facts: Mapping[str, int]) -> bool:
    """A Mamba layer in the profile (``layer_type``) or ``model_facts["mamba_layers"]`` > 0."""
    if facts.get("mamba_layers", 0) > 0:
        return True
    return any(kind in MAMBA for layer in profile.layers for kind in components(layer))


def parallel_degrees(
    profile: profile_pb2.Profile,
    devices: int,
    *,
    facts: Mapping[str, int] | None,
    tp_degrees: Sequence[int] | None,
    cp_degrees: Sequence[int] | None,
    node_size: int,
    max_cp: int,
) -> ParallelChoice:
    """The (tp, cp) pairs to search for ``devices`` devices (module doc)."""
    known = dict(facts or {})
    if tp_degrees is not None:
        tps = sorted(set(tp_degrees) | {1})
    elif any(known.get(name, 0) for name in TP_FACTS):
        tps = [t for t in range(1, node_size + 1) if devices % t == 0]
    else:
        tps = [1]
    excluded: list[str] = []
    if cp_degrees is not None:
        cps = sorted(set(cp_degrees) | {1})
    elif known.get("sequence", 0):
        cps = [c for c in range(1, min(max_cp, known["sequence"]) + 1) if known["sequence"] % c == 0]
    else:
        cps = [1]
    if len(cps) > 1 and has_mamba(profile, known):
        excluded.append(f"cp in {cps[1:]}: the model has Mamba layers, whose scan needs the whole sequence")
        cps = [1]
    pairs: list[tuple[int, int]] = []
    for tp in tps:
        for cp in cps:
            if devices % (tp * cp):
                excluded.append(f"tp={tp} x cp={cp} does not divide {devices} devices")
                continue
            spec = MeshSpec(pp=1, dp=1, ep=1, global_ranks=tuple(range(tp * cp)), tp=tp, cp=cp)
            try:
                check_mesh_model(spec, known)
            except PlanError as exc:
                excluded.append(str(exc))
                continue
            pairs.append((tp, cp))
    pairs.sort(key=lambda pair: (pair != (1, 1), pair))
    return ParallelChoice(pairs=tuple(pairs), excluded=tuple(excluded))


def step_lower_bound_us(layers: Layers, pp: int, m: int, hidden_fraction: float) -> float:
    """No plan of these per-rank layer costs on ``pp`` ranks with ``m`` micro-batches has a shorter step."""
    total = heaviest = 0.0
    for cost in layers.shares:
        split = cost.backward_input_duration_us + cost.backward_weight_duration_us
        full = cost.full_backward_duration_us if cost.HasField("full_backward_duration_us") else split
        work = cost.forward_duration_us + min(split, full)
        total += work
        heaviest = max(heaviest, work)
    return m * max(total / pp, heaviest) * (1.0 - hidden_fraction / 2.0)


def scale_microbatches(profile: profile_pb2.Profile, factor: int) -> profile_pb2.Profile:
    """``profile`` for micro-batches ``factor`` times larger: per-micro-batch times and bytes x factor."""
    if factor == 1:
        return profile
    scaled = profile_pb2.Profile()
    scaled.CopyFrom(profile)
    scaled.microbatch_size = max(1, profile.microbatch_size) * factor
    for layer in scaled.layers:
        layer.forward_duration_us *= factor
        layer.backward_input_duration_us *= factor
        layer.backward_weight_duration_us *= factor
        if layer.HasField("full_backward_duration_us"):
            layer.full_backward_duration_us *= factor
        layer.activation_saved_bytes *= factor
        layer.activation_freed_by_backward_input_bytes *= factor
        layer.activation_freed_by_backward_weight_bytes *= factor
        layer.backward_input_kept_bytes *= factor
        layer.forward_scratch_bytes *= factor  # activation-sized intermediates (gradient parts do not scale)
        layer.backward_input_scratch_bytes *= factor
        layer.all_to_all_bytes *= factor
        for name in (  # tensor / context parallel volumes given by the profile grow with the activations
            "tensor_parallel_all_reduce_bytes",
            "context_parallel_gather_bytes",
            "tensor_parallel_replicated_activation_bytes",
        ):
            if layer.HasField(name):
                setattr(layer, name, getattr(layer, name) * factor)
        for tensor in layer.output_tensors:
            tensor.size_bytes *= factor
            if tensor.shape:
                tensor.shape[0] *= factor
    del scaled.fused[:]  # measured at the old size
    return scaled
