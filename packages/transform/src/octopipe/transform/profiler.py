"""The layer profiler: time and size each layer's F, B and W graphs; write a Profile.

Each layer is compiled alone as a one-layer stage by the same
:class:`~octopipe.transform.compiler.StageCompiler` the runtime compiles its
stages with (so its costs are those of the graphs the runtime runs), and each
graph timed: warm-up runs first, then the median of ``repeats`` timed runs.
W and the fused backward are timed with the add of their weight gradients into
float32 accumulators, as the runtime's interpreter adds them for each micro-batch.
Timing and memory follow the profiler's device (``ProfilerConfig.device``,
the model and inputs must be on it): on CPU the host clock and the profiler's
memory events, on CUDA events around each graph (each sample waits for its own
end event, which is what measuring needs) and the CUDA allocator's peak; the
layers are timed in the dtype they hold (bf16 for a bf16 plan).
Bytes are counted by storage, so views share their base's bytes and tensors
that alias parameters (a transposed weight saved for backward) are not
counted as activations.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from octopipe.capture import CaptureConfig, PipelineSpec, StageModule, pipeline_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.transform.compiler import StageCompiler
from octopipe.transform.device import CPU, Device
from octopipe.transform.executable import StageExecutable
from octopipe.transform.host_memory import HostMemory, configure_host_memory, host_memory_policy

__all__ = ["ProfilerConfig", "format_profile", "profile_layers", "profile_stages", "storage_bytes", "storage_pointers"]


#: what weight gradients accumulate in and the optimizer steps (float32), and its bytes per element
_GRAD_DTYPE = torch.float32
_MASTER_BYTES = 4


@dataclass(kw_only=True, frozen=True)
class ProfilerConfig:
    """How to profile. ``optimizer_state_factor``: optimizer state bytes per float32 weight byte (AdamW: 2).
    ``device``: where the model and inputs are, and so what times and meters the graphs. ``host_memory``:
    the C allocator policy the layers are timed under (``transform.host_memory``; the profiler applies it to
    this process, as the runtime applies it to every rank, and the Profile's ``host_memory`` label says
    whether it took effect). ``evict_bytes``: bytes written between each sample's preparation and its timed run
    (0: none), so that a sample starts with caches holding none of the layer's weights and activations, as an
    action inside a pipeline may (``bench/profile_conditions.py`` measures whether that is what the pipeline
    sees); the Profile's ``evict_bytes`` label records it. ``before_sample``: called right before each sample's
    clock starts (after its preparation and eviction): profilers in several processes, each running the same
    layers, pass a barrier's wait so that their samples run together, as a pipeline's ranks compute together
    (``octopipe.execute.runtime.lockstep``). ``recompute``: recomputation policies (capture configurations with
    ``recompute`` set) each layer is also compiled and profiled with; each lands in the layer's ``recomputed``
    under its label (``layers``, ``budget:0.5``), for plans whose stages recompute."""

    repeats: int = 5
    warmup: int = 2
    optimizer_state_factor: float = 2.0
    device: Device = CPU
    host_memory: HostMemory = "reuse"
    evict_bytes: int = 0
    before_sample: Callable[[], object] | None = None
    recompute: tuple[CaptureConfig, ...] = ()

    def __post_init__(self) -> None:
        labels = [c.recompute_label for c in self.recompute]
        if "none" in labels or len(set(labels)) != len(labels):
            raise ValueError(f"recompute lists policies to profile besides saving, each once; got {labels}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")
        if self.evict_bytes < 0:
            raise ValueError(f"evict_bytes must be >= 0 (0: no eviction), got {self.evict_bytes}")
        host_memory_policy(self.host_memory)


def storage_pointers(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The data pointers of ``tensors``' storages: an ``exclude`` for :func:`storage_bytes`, made once."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def storage_bytes(tensors: Iterable[object], *, exclude: Iterable[torch.Tensor] | set[int] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those of ``exclude`` (tensors, or their
    :func:`storage_pointers` when the same ones are left out again and again)."""
    skip = exclude if isinstance(exclude, set) else storage_pointers(exclude)
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _median_us(run: Callable[[], object], prepare: Callable[[], object], config: ProfilerConfig) -> float:
    samples = []
    # written before each timed run: what the caches held is replaced by this buffer's lines
    evict = config.device.empty((config.evict_bytes // 4,), torch.float32) if config.evict_bytes else None
    for index in range(config.warmup + config.repeats):
        prepare()
        if evict is not None:
            evict.fill_(float(index))
            config.device.synchronize()
        if config.before_sample is not None:
            config.before_sample()
        watch = config.device.stopwatch()
        watch.mark()
        run()
        watch.mark()
        if index >= config.warmup:
            samples.append(watch.elapsed_us(0, 1))
    return statistics.median(samples)


def _scratch(device: Device, run: Callable[[], object], kept: Callable[[], int] = lambda: 0) -> int:
    """The allocator's peak during ``run`` above the bytes ``run`` made and keeps (``kept()`` afterwards):
    its intermediates. (Not above the allocator's end level: frees of older tensors inside the window, which
    the allocator may or may not report, would move it.)"""
    with device.memory_window() as meter:
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
    compiler: StageCompiler | None = None,
) -> profile_pb2.Profile:
    """Profile every layer of ``model`` (its layer list) for one micro-batch (``inputs``, ``target``)."""
    config = config or ProfilerConfig()
    compiler = compiler or StageCompiler()
    spec = _spec_of(model, spec)
    kind_of = layer_kind or getattr(model, "layer_kind", None) or (lambda name: "layer")
    profile = _new_profile(int(inputs.shape[0]), config, links, model_reference)
    x = inputs
    count = len(spec.layers)
    for index, layer in enumerate(spec.layers):
        last = index == count - 1
        stage = StageModule(model, [layer], stage_index=index, num_stages=count, loss=spec.loss if last else None)
        stage_inputs = [x, target] if last else [x]
        key = _key("layer", layer.name, stage_inputs)
        profiled = _variants(compiler, stage, stage_inputs, key, config, layer.name, kind_of(layer.name), index, last)
        profile.layers.append(profiled)
        _expert_costs(profile.layers[-1], stage, x)
        with torch.no_grad():
            x = stage(*stage_inputs)
    return profile


def profile_stages(
    stages: Sequence[nn.Module],
    examples: Sequence[Sequence[torch.Tensor]],
    layer_names: Sequence[str],
    *,
    microbatch_size: int,
    config: ProfilerConfig | None = None,
    layer_kind: Callable[[str], str] | None = None,
    links: Sequence[profile_pb2.LinkCost] = (),
    model_reference: plan_pb2.ModelReference | None = None,
    compiler: StageCompiler | None = None,
) -> profile_pb2.Profile:
    """Profile one-layer stages cut from a whole-model graph (``octopipe.capture.split_graph``, one
    layer per stage), each on its example inputs: the graphs the runtime runs for a model captured as
    written. A stage may take and return several tensors (hidden states, router logits, token ids);
    ``output_tensors`` lists every boundary output, the backward seeds only those with a gradient."""
    if not len(stages) == len(examples) == len(layer_names):
        raise ValueError(
            f"{len(stages)} stages, {len(examples)} example input lists and {len(layer_names)} layer names: "
            "give one of each per layer"
        )
    config = config or ProfilerConfig()
    compiler = compiler or StageCompiler()
    kind_of = layer_kind or (lambda name: "layer")
    profile = _new_profile(microbatch_size, config, links, model_reference)
    for index, (stage, inputs, name) in enumerate(zip(stages, examples, layer_names, strict=True)):
        last = index == len(stages) - 1
        key = _key("stage", name, inputs)
        profile.layers.append(_variants(compiler, stage, list(inputs), key, config, name, kind_of(name), index, last))
    return profile


def _key(kind: str, name: str, inputs: Sequence[torch.Tensor]) -> tuple[object, ...]:
    """The compiler's cache key of a profiled layer: ``compiler.compiled`` shows what was timed."""
    return ("profiled", kind, name, tuple((tuple(x.shape), x.dtype) for x in inputs))


def _new_profile(
    microbatch_size: int,
    config: ProfilerConfig,
    links: Sequence[profile_pb2.LinkCost],
    model_reference: plan_pb2.ModelReference | None,
) -> profile_pb2.Profile:
    profile = profile_pb2.Profile(device=config.device.kind, microbatch_size=microbatch_size)
    if model_reference is not None:
        profile.model.CopyFrom(model_reference)
    profile.labels["torch"] = torch.__version__
    profile.labels["threads"] = str(torch.get_num_threads())
    profile.labels["repeats"] = str(config.repeats)
    profile.labels["timing"] = config.device.timing
    profile.labels["evict_bytes"] = str(config.evict_bytes)
    memory = configure_host_memory(config.host_memory)  # the allocator the runtime's ranks run with
    applied = memory.applied or memory.policy == "system"
    profile.labels["host_memory"] = memory.policy if applied else f"{memory.policy} (not applied: {memory.reason})"
    profile.links.extend(links)
    return profile


def _profiled(
    exe: StageExecutable,
    inputs: list[torch.Tensor],
    config: ProfilerConfig,
    name: str,
    kind: str,
    index: int,
    last: bool,
) -> profile_pb2.LayerCost:
    cost = _layer_cost(exe, inputs, config)
    cost.layer_name = name
    cost.layer_type = kind
    cost.input_without_gradient = index == 0  # the model's data: a stage starting here has no I to compute
    if not last:
        outputs, _ = exe.forward_all(inputs)
        for out in outputs:
            cost.output_tensors.add(
                shape=list(out.shape),
                dtype=str(out.dtype).removeprefix("torch."),
                size_bytes=out.numel() * out.element_size(),
            )
    return cost


def _variants(
    compiler: StageCompiler,
    stage: nn.Module,
    inputs: list[torch.Tensor],
    key: tuple[object, ...],
    config: ProfilerConfig,
    name: str,
    kind: str,
    index: int,
    last: bool,
) -> profile_pb2.LayerCost:
    """The layer's cost as compiled by ``compiler``, with one ``recomputed`` entry per policy of ``config``."""
    exe = compiler.executable(stage, inputs, stage_index=index, key=key)
    cost = _profiled(exe, inputs, config, name, kind, index, last)
    for policy in config.recompute:
        variant_exe = compiler.executable(stage, inputs, stage_index=index, key=key, config=policy)
        variant = _profiled(variant_exe, inputs, config, name, kind, index, last)
        variant.recompute = policy.recompute_label
        cost.recomputed.append(variant)
    return cost


def _expert_costs(cost: profile_pb2.LayerCost, stage: nn.Module, x: torch.Tensor) -> None:
    """A layer with MoE modules: its experts, their bytes and its all-to-all bytes per forward, from each
    module's ``expert_costs(tokens)`` (the zoo's MoE has it): what the mesh search needs to choose ep."""
    tokens = x.shape[0] * x.shape[1] if x.dim() >= 2 else x.numel()
    hooks = [getattr(m, "expert_costs", None) for m in stage.modules()]
    found: list[tuple[int, int, int]] = [hook(tokens) for hook in hooks if callable(hook)]
    if not found:
        return
    counts = {experts for experts, _, _ in found}
    cost.num_experts = math.gcd(*counts)  # an ep that divides it divides every MoE module's experts
    cost.expert_parameter_bytes = sum(size for _, size, _ in found)
    cost.all_to_all_bytes = sum(sent for _, _, sent in found)


def _layer_cost(exe: StageExecutable, inputs: list[torch.Tensor], config: ProfilerConfig) -> profile_pb2.LayerCost:
    state: dict[str, object] = {}
    static = [*exe.params, *exe.buffers]

    flags = exe.graphs.output_requires_grad

    def seeds() -> list[torch.Tensor | None]:  # a gradient of ones for each output that carries one
        outs = state["out"]
        assert isinstance(outs, list)
        return [torch.ones_like(o) if needed else None for o, needed in zip(outs, flags, strict=True)]

    def forward() -> None:
        state["out"], state["ctx"] = exe.forward_all(inputs)

    def backward_input() -> None:
        state["grads"], state["wctx"] = exe.backward_input_all(state["ctx"], seeds())  # type: ignore[arg-type]

    def backward_weight() -> None:
        exe.backward_weight(state["wctx"])  # type: ignore[arg-type]

    def full() -> None:
        exe.full_backward_all(state["ctx"], seeds())  # type: ignore[arg-type]

    # the runtime adds each micro-batch's weight gradients into float32 accumulators (out of place, as its
    # interpreter does): W and the fused backward are timed with that add, the cost of the action it runs
    accumulators = [torch.zeros(p.shape, dtype=_GRAD_DTYPE, device=p.device) for p in exe.params]

    def accumulate(grads: Sequence[torch.Tensor | None]) -> None:
        for acc, grad in zip(accumulators, grads, strict=True):
            if grad is not None:
                _ = acc + grad.to(_GRAD_DTYPE)

    def backward_weight_accumulated() -> None:
        accumulate(exe.backward_weight(state["wctx"]))  # type: ignore[arg-type]

    def full_accumulated() -> None:
        accumulate(exe.full_backward_all(state["ctx"], seeds())[1])  # type: ignore[arg-type]

    def nothing() -> None:
        return None

    def forward_then_b() -> None:
        forward()
        backward_input()

    cost = profile_pb2.LayerCost()
    cost.forward_duration_us = _median_us(forward, nothing, config)
    cost.backward_input_duration_us = _median_us(backward_input, forward, config)
    cost.backward_weight_duration_us = _median_us(backward_weight_accumulated, forward_then_b, config)
    cost.full_backward_duration_us = _median_us(full_accumulated, forward, config)
    del accumulators[:]

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

    def forward_kept() -> int:  # the outputs and what F saved (the inputs and parameters are not F's)
        return storage_bytes([*state["out"], *(state["ctx"].saved or [])], exclude=outside)  # type: ignore[attr-defined,misc]

    def input_kept() -> int:  # the input gradients and what I made for W
        made = [*state["grads"], *(state["wctx"].tensors or [])]  # type: ignore[attr-defined,misc]
        return storage_bytes(made, exclude=[*outside, *saved_before])

    cost.forward_scratch_bytes = _scratch(config.device, forward, forward_kept)
    saved_before[:] = [t for t in state["ctx"].saved or [] if isinstance(t, torch.Tensor)]  # type: ignore[attr-defined]
    cost.backward_input_scratch_bytes = _scratch(config.device, backward_input, input_kept)
    saved_before.clear()
    # W and the fused backward return the parameter gradients: their bytes are part of the scratch by design
    cost.backward_weight_scratch_bytes = _scratch(config.device, backward_weight)
    forward()
    cost.full_backward_scratch_bytes = _scratch(config.device, full)
    state.clear()
    cost.activation_saved_bytes = saved
    cost.activation_freed_by_backward_weight_bytes = held
    cost.activation_freed_by_backward_input_bytes = max(0, saved - (held - kept))
    cost.backward_input_kept_bytes = kept
    params = [p for p in exe.params]
    cost.parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    # as the runtime holds them (octopipe.execute.runtime.precision): weight gradients accumulate in float32
    # and the optimizer steps float32 weights, the parameters themselves or float32 masters of bf16 ones
    master = sum(p.numel() for p in params) * _MASTER_BYTES
    cost.gradient_bytes = master
    copies = sum(p.numel() * _MASTER_BYTES for p in params if p.dtype != torch.float32)
    cost.optimizer_state_bytes = int(master * config.optimizer_state_factor) + copies
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
