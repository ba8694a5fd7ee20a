"""The layer profiler: time and size each layer's F, B and W graphs; write a Profile.

Each layer is captured alone (as a one-layer stage, so its costs are those of
the same graphs the runtime runs), its backward split into B and W, and each
graph timed: warm-up runs first, then the median of ``repeats`` timed runs.
Bytes are counted by storage, so views share their base's bytes and tensors
that alias parameters (a transposed weight saved for backward) are not
counted as activations.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture import PipelineSpec, StageModule, capture_stage, pipeline_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.transform.allocator import AllocatorPeak
from octopipe.transform.executable import StageExecutable

__all__ = ["ProfilerConfig", "format_profile", "profile_layers", "storage_bytes"]


@dataclass(kw_only=True, frozen=True)
class ProfilerConfig:
    """How to profile. ``optimizer_state_factor``: optimizer bytes per parameter byte (AdamW: 2)."""

    repeats: int = 5
    warmup: int = 2
    optimizer_state_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")


def storage_bytes(tensors: Iterable[object], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those of ``exclude``."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _median_us(run: Callable[[], object], prepare: Callable[[], object], repeats: int, warmup: int) -> float:
    samples = []
    for index in range(warmup + repeats):
        prepare()
        start = time.perf_counter_ns()
        run()
        elapsed = time.perf_counter_ns() - start
        if index >= warmup:
            samples.append(elapsed / 1000.0)
    return statistics.median(samples)


def _scratch(run: Callable[[], object], kept: Callable[[], int] = lambda: 0) -> int:
    """The allocator's peak during ``run`` above the bytes ``run`` made and keeps (``kept()`` afterwards):
    its intermediates. (Not above the allocator's end level: frees of older tensors inside the window, which
    the allocator may or may not report, would move it.)"""
    with AllocatorPeak() as meter:
        run()
    return max(0, meter.peak_bytes - kept())


def _spec_of(model: nn.Module, spec: PipelineSpec | None) -> PipelineSpec:
    return spec if spec is not None else pipeline_spec(model)


def profile_layers(
    model: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor,
    *,
    spec: PipelineSpec | None = None,
    config: ProfilerConfig | None = None,
    layer_kind: Callable[[str], str] | None = None,
    links: Sequence[profile_pb2.LinkCost] = (),
    model_reference: plan_pb2.ModelReference | None = None,
) -> profile_pb2.Profile:
    """Profile every layer of ``model`` for one micro-batch (``inputs``, ``target``)."""
    config = config or ProfilerConfig()
    spec = _spec_of(model, spec)
    kind_of = layer_kind or getattr(model, "layer_kind", None) or (lambda name: "layer")
    profile = profile_pb2.Profile(device="cpu", microbatch_size=int(inputs.shape[0]))
    if model_reference is not None:
        profile.model.CopyFrom(model_reference)
    profile.labels["torch"] = torch.__version__
    profile.labels["threads"] = str(torch.get_num_threads())
    profile.labels["repeats"] = str(config.repeats)
    profile.links.extend(links)
    x = inputs
    count = len(spec.layers)
    for index, layer in enumerate(spec.layers):
        last = index == count - 1
        stage = StageModule(model, [layer], stage_index=index, num_stages=count, loss=spec.loss if last else None)
        stage_inputs = [x, target] if last else [x]
        graphs = capture_stage(stage, stage_inputs, stage_index=index)
        exe = StageExecutable.from_module(stage, graphs)
        cost = _layer_cost(exe, stage_inputs, config)
        cost.layer_name = layer.name
        cost.layer_type = kind_of(layer.name)
        cost.input_without_gradient = index == 0  # the model's data: a stage starting here has no I to compute
        with torch.no_grad():
            out = stage(*stage_inputs)
        if not last:
            cost.output_tensors.add(
                shape=list(out.shape),
                dtype=str(out.dtype).removeprefix("torch."),
                size_bytes=out.numel() * out.element_size(),
            )
        profile.layers.append(cost)
        x = out
    return profile


def _layer_cost(exe: StageExecutable, inputs: list[torch.Tensor], config: ProfilerConfig) -> profile_pb2.LayerCost:
    state: dict[str, object] = {}
    static = [*exe.params, *exe.buffers]

    def forward() -> None:
        state["out"], state["ctx"] = exe.forward(inputs)

    def backward_input() -> None:
        out = state["out"]
        assert isinstance(out, torch.Tensor)
        state["grads"], state["wctx"] = exe.backward_input(state["ctx"], torch.ones_like(out))  # type: ignore[arg-type]

    def backward_weight() -> None:
        exe.backward_weight(state["wctx"])  # type: ignore[arg-type]

    def full() -> None:
        out = state["out"]
        assert isinstance(out, torch.Tensor)
        exe.full_backward(state["ctx"], torch.ones_like(out))  # type: ignore[arg-type]

    def nothing() -> None:
        return None

    def forward_then_b() -> None:
        forward()
        backward_input()

    cost = profile_pb2.LayerCost()
    cost.forward_duration_us = _median_us(forward, nothing, config.repeats, config.warmup)
    cost.backward_input_duration_us = _median_us(backward_input, forward, config.repeats, config.warmup)
    cost.backward_weight_duration_us = _median_us(backward_weight, forward_then_b, config.repeats, config.warmup)
    cost.full_backward_duration_us = _median_us(full, forward, config.repeats, config.warmup)

    forward()
    ctx = state["ctx"]
    saved_tensors = list(ctx.saved or [])  # type: ignore[attr-defined]
    saved = storage_bytes(saved_tensors, exclude=static)
    backward_input()
    kept_for_w = list(state["wctx"].tensors or [])  # type: ignore[attr-defined]
    held = storage_bytes(kept_for_w, exclude=static)
    # what I made and keeps for W (output gradients), as opposed to what F saved and W still needs
    kept = storage_bytes(kept_for_w, exclude=[*static, *(t for t in saved_tensors if isinstance(t, torch.Tensor))])
    del saved_tensors, kept_for_w
    backward_weight()
    # scratch: each action once more under the allocator meter (untimed: the profiler slows what it watches)
    outside = [*static, *inputs]
    saved_before: list[torch.Tensor] = []  # what F saved, before I runs (I's own tensors are the others)

    def forward_kept() -> int:  # the output and what F saved (the inputs and parameters are not F's)
        return storage_bytes([state["out"], *(state["ctx"].saved or [])], exclude=outside)  # type: ignore[attr-defined]

    def input_kept() -> int:  # the input gradients and what I made for W
        made = [*state["grads"], *(state["wctx"].tensors or [])]  # type: ignore[attr-defined,misc]
        return storage_bytes(made, exclude=[*outside, *saved_before])

    cost.forward_scratch_bytes = _scratch(forward, forward_kept)
    saved_before[:] = [t for t in state["ctx"].saved or [] if isinstance(t, torch.Tensor)]  # type: ignore[attr-defined]
    cost.backward_input_scratch_bytes = _scratch(backward_input, input_kept)
    saved_before.clear()
    # W and the fused backward return the parameter gradients: their bytes are part of the scratch by design
    cost.backward_weight_scratch_bytes = _scratch(backward_weight)
    forward()
    cost.full_backward_scratch_bytes = _scratch(full)
    state.clear()
    cost.activation_saved_bytes = saved
    cost.activation_freed_by_backward_weight_bytes = held
    cost.activation_freed_by_backward_input_bytes = max(0, saved - (held - kept))
    cost.backward_input_kept_bytes = kept
    params = [p for p in exe.params]
    cost.parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    cost.gradient_bytes = cost.parameter_bytes
    cost.optimizer_state_bytes = int(cost.parameter_bytes * config.optimizer_state_factor)
    return cost


def format_profile(profile: profile_pb2.Profile) -> str:
    """A readable table of a Profile: one row per layer, times in ms, bytes in KiB."""
    header = f"{'layer':<18} {'type':<18} {'F ms':>8} {'B ms':>8} {'W ms':>8} {'B+W ms':>8} {'fused ms':>9} {'saved KiB':>10} {'B->W KiB':>9} {'params KiB':>11}"
    lines = [
        f"profile of {profile.model.name or 'a model'} on {profile.device}, micro-batch {profile.microbatch_size}",
        header,
    ]
    for c in profile.layers:
        fused = c.full_backward_duration_us if c.HasField("full_backward_duration_us") else float("nan")
        lines.append(
            f"{c.layer_name:<18} {c.layer_type:<18} {c.forward_duration_us / 1e3:>8.3f} {c.backward_input_duration_us / 1e3:>8.3f} "
            f"{c.backward_weight_duration_us / 1e3:>8.3f} {(c.backward_input_duration_us + c.backward_weight_duration_us) / 1e3:>8.3f} "
            f"{fused / 1e3:>9.3f} {c.activation_saved_bytes / 1024:>10.1f} {c.activation_freed_by_backward_weight_bytes / 1024:>9.1f} "
            f"{c.parameter_bytes / 1024:>11.1f}"
        )
    for link in profile.links:
        lines.append(
            f"link {link.source_rank}->{link.destination_rank}: latency {link.latency_us:.1f} us, "
            f"bandwidth {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"
        )
    return "\n".join(lines) + "\n"
