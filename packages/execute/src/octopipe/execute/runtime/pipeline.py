"""The profile -> tune -> simulate -> run chain, in one place for the demo, the benches and users.

Each function is one step and takes and returns protos or plain data, so a
caller can stop after any of them, write the result, and go on later (that is
what the ``octopipe profile``, ``tune``, ``simulate`` and ``run`` commands do):

- :func:`profile_reference`: build the model a ``ModelReference`` names and time
  and size each layer's F, B and W graphs on this machine (optionally with the
  local gloo link measured too);
- :func:`baseline_plan`: 1F1B with equal layer counts per stage, the plan the
  tuner is compared against;
- :func:`tune_reference`: the tuner, with the plan pointed at the profile's model;
- :func:`compare`: predicted (simulator, from the profile) vs measured (one or
  more ``RunResult`` of the plan): step time, activation memory, and a replay of
  the simulator with the measured per-action durations.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from octopipe.capture import CaptureConfig, pipeline_spec, trace_model
from octopipe.execute.runtime import (
    RunResult,
    build_model,
    measured_step_times_us,
    median_step_time_us,
    timelines_to_proto,
)
from octopipe.execute.runtime.linkprobe import local_links
from octopipe.execute.runtime.models import model_inputs, on_device
from octopipe.execute.runtime.precision import dtype_named, in_precision
from octopipe.execute.runtime.pretrained import params_on_meta, placeholders
from octopipe.execute.runtime.whole_model import whole_model_stages
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.simulate import (
    CostModel,
    FittedTerm,
    RuntimeCosts,
    Simulation,
    SimulationConfig,
    calibrate_profile,
    durations_from_timelines,
    fit_message_costs,
    local_cost_model,
    local_link,
    simulate,
)
from octopipe.transform import Device, ProfilerConfig, StageCompiler, profile_layers, profile_stages
from octopipe.tune import TuneConfig, TuneResult, equal_partition, one_f_one_b, tune, zb_h1

__all__ = [
    "Comparison",
    "InSitu",
    "baseline_plan",
    "calibrate_in_situ",
    "compare",
    "layer_names",
    "profile_reference",
    "speedup",
    "tune_reference",
]


def layer_names(reference: plan_pb2.ModelReference) -> list[str]:
    """The pipeline layers of the model ``reference`` names, in execution order (a model captured whole:
    the layers of its traced forward, as the runtime splits it)."""
    with params_on_meta():  # no weights: storage-free placeholders are enough to trace
        built = build_model(reference)
    placeholders(built.model, torch.device("cpu"))
    if built.input_names is None:
        return list(pipeline_spec(built.model).names)
    inputs, targets = built.batch(0)
    names = built.input_names
    return list(trace_model(built.model, model_inputs(names, inputs, targets), targets=[names[1]]).layers)


def profile_reference(
    reference: plan_pb2.ModelReference,
    *,
    num_microbatches: int,
    num_ranks: int = 2,
    link: profile_pb2.LinkCost | None = None,
    repeats: int = 5,
    seed: int = 0,
    compiler: StageCompiler | None = None,
    precision: str = "",
    device: str = "cpu",
    evict_bytes: int = 0,
    before_sample: Callable[[], object] | None = None,
    recompute: Sequence[CaptureConfig] = (),
) -> profile_pb2.Profile:
    """Profile the layers of the model ``reference`` names on one micro-batch of its step-0 batch.

    ``recompute``: ``ProfilerConfig.recompute`` (each layer also profiled under these recomputation policies,
    for plans whose stages recompute).

    ``before_sample``: ``ProfilerConfig.before_sample`` (``runtime.lockstep`` profiles in one pinned process
    per rank, their samples started together by it).

    ``evict_bytes``: ``ProfilerConfig.evict_bytes`` (bytes written before each timed sample, to start it with
    cold caches; 0, the default: none).

    ``device``: where the layers run and are timed (``cpu``, or ``cuda[:N]``: CUDA events and the CUDA
    allocator; the Profile's ``device`` says which).

    ``precision``: the compute dtype (``float32``, the default, or ``bfloat16``), as a plan's
    ``precision.compute_dtype``: the model is cast to it as the runtime casts it, and the Profile
    records it (``Profile.precision``) so that plans tuned from it run in it.

    Each layer is compiled by ``compiler`` (a fresh ``StageCompiler`` by default), the compiler the
    runtime compiles its stages with.

    The micro-batch is the global batch split in ``num_microbatches`` (as the
    runtime splits it). ``link``: a measured link (``linkprobe.measure_link``),
    written for every pair of ``num_ranks`` local ranks; without one the
    simulator assumes ``simulate.LOCAL_GLOO_LINK``. Runs on one thread, as each
    local rank does.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    where = Device.parse(device)
    where.activate()
    built = on_device(in_precision(build_model(reference, seed=seed), dtype_named(precision)), where)
    inputs, targets = built.batch(0)
    size = inputs.shape[0] // num_microbatches
    if size < 1 or inputs.shape[0] % num_microbatches:
        raise ValueError(
            f"a global batch of {inputs.shape[0]} does not split into {num_microbatches} micro-batches: "
            "choose a micro-batch count that divides it"
        )
    links = local_links(link, num_ranks) if link is not None else ()
    config = ProfilerConfig(
        repeats=repeats,
        device=where,
        evict_bytes=evict_bytes,
        before_sample=before_sample,
        recompute=tuple(recompute),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if built.input_names is not None:  # captured whole: time the graphs the runtime runs, one layer each
            whole = whole_model_stages(built.model, built.input_names, (inputs[:size], targets[:size]))
            profile = profile_stages(
                whole.stages,
                whole.examples,
                [stage.layer_names[0] for stage in whole.stages],
                microbatch_size=size,
                config=config,
                links=links,
                model_reference=reference,
                compiler=compiler,
            )
            if precision:
                profile.precision.compute_dtype = precision
            for tie in whole.ties:  # one layer per stage: the stages that hold it are its layers
                stage, name = tie.uses[0]
                weight = whole.stages[stage].get_parameter(name)
                profile.tied_parameters.add(
                    name=tie.name,
                    size_bytes=weight.numel() * weight.element_size(),
                    layer_names=[whole.stages[s].layer_names[0] for s in tie.stages],
                )
            return profile
        profile = profile_layers(
            built.model,
            inputs[:size],
            targets[:size],
            config=config,
            links=links,
            model_reference=reference,
            compiler=compiler,
        )
        if precision:
            profile.precision.compute_dtype = precision
        return profile
    finally:
        torch.set_num_threads(threads)


def baseline_plan(
    reference: plan_pb2.ModelReference,
    *,
    num_ranks: int,
    num_microbatches: int,
    names: Sequence[str] | None = None,
    schedule: str = "1f1b",
) -> plan_pb2.Plan:
    """1F1B (or ``schedule``: "zb-h1") on equal layer counts per stage (one stage per rank) for the model
    ``reference`` names."""
    chosen = list(names) if names is not None else layer_names(reference)
    build = {"1f1b": one_f_one_b, "zb-h1": zb_h1}.get(schedule)
    if build is None:
        raise ValueError(f"schedule {schedule!r}: use 1f1b or zb-h1")
    plan = build(num_ranks, num_microbatches, layer_names=equal_partition(chosen, num_ranks))
    plan.model.CopyFrom(reference)
    return plan


def tune_reference(
    profile: profile_pb2.Profile,
    config: TuneConfig,
    *,
    progress: Callable[[str, int, float], None] | None = None,
) -> TuneResult:
    """``octopipe.tune.tune`` for local ranks, with the tuned plan naming the profile's model (so it can
    run as is). Unless ``config.default_link`` is set, it tunes with ``simulate.local_link(profile)``, the
    link ``local_cost_model`` verifies and predicts with.

    ``progress(message, simulations, best_step_us)`` is called as the search goes.
    """
    if config.default_link is None:
        config = dataclasses.replace(config, default_link=local_link(profile))
    result = tune(profile, config, progress=progress)
    result.plan.model.CopyFrom(profile.model)
    return result


def speedup(baseline_us: float, tuned_us: float) -> float:
    """How many times faster the tuned step is than the baseline's."""
    return baseline_us / tuned_us if tuned_us > 0 else float("nan")


@dataclass(kw_only=True, frozen=True)
class Comparison:
    """Predicted vs measured for one plan. Times in microseconds, memory in bytes, per rank where a tuple."""

    plan_name: str
    simulation: Simulation
    #: every measured step of every run, in order (the first of each run is warm-up)
    measured_steps_us: tuple[float, ...]
    #: the median step, warm-up steps left out
    measured_step_us: float
    #: the simulator with the measured per-action durations (what is left is runtime overhead)
    replay_step_us: float
    #: the most bytes the runtime's own count says it held per rank (activations, gradients in flight,
    #: messages): its bookkeeping, not the allocator's
    measured_activation_bytes: tuple[int, ...]
    #: the allocator's peak per rank (runtime.memory; runs with ``measure_memory=True``), the most over runs
    allocator_memory_bytes: tuple[int, ...] = ()
    #: steps per run, in order (``measured_steps_us`` is their concatenation)
    run_lengths: tuple[int, ...] = ()
    #: measured / predicted time per action, summed over stages: ``F``, ``I+W`` (together: a first stage's
    #: I has no input gradient to compute, so its work moves to W) and ``B``, for the kinds the plan has
    slowdown: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def predicted_step_us(self) -> float:
        return self.simulation.estimate.step_time_us

    @property
    def predicted_activation_bytes(self) -> tuple[int, ...]:
        return tuple(r.peak_activation_bytes for r in self.simulation.estimate.ranks)

    @property
    def predicted_memory_bytes(self) -> tuple[int, ...]:
        """Peak per rank: parameters, gradients and optimizer state plus activations."""
        return tuple(r.peak_memory_bytes for r in self.simulation.estimate.ranks)

    @property
    def measured_memory_bytes(self) -> tuple[int, ...]:
        """The allocator-measured peak per rank (empty when no run measured it)."""
        return self.allocator_memory_bytes

    @property
    def memory_error(self) -> float | None:
        """The largest |predicted - allocator-measured| / measured peak over ranks (None if not measured)."""
        if not self.allocator_memory_bytes:
            return None
        return max(
            abs(p - m) / m for p, m in zip(self.predicted_memory_bytes, self.allocator_memory_bytes, strict=True)
        )

    @property
    def step_time_error(self) -> float:
        """|predicted - measured| / measured."""
        return abs(self.predicted_step_us - self.measured_step_us) / self.measured_step_us

    @property
    def spread(self) -> float:
        """(p90 - p10) / median of the timed (not warm-up) steps: the measurement's own noise."""
        ordered = sorted(self.timed_steps_us)
        low, high = ordered[round(0.1 * (len(ordered) - 1))], ordered[round(0.9 * (len(ordered) - 1))]
        return (high - low) / statistics.median(ordered)

    @property
    def timed_steps_us(self) -> tuple[float, ...]:
        """The measured steps without each run's warm-up step."""
        return tuple(_timed(self.measured_steps_us, self.run_lengths))

    def as_json(self) -> dict[str, object]:
        return {
            "plan": self.plan_name,
            "predicted_step_ms": self.predicted_step_us / 1e3,
            "measured_step_ms": self.measured_step_us / 1e3,
            "measured_steps_ms": [t / 1e3 for t in self.measured_steps_us],
            "replay_step_ms": self.replay_step_us / 1e3,
            "step_time_error": self.step_time_error,
            "predicted_peak_activation_bytes": list(self.predicted_activation_bytes),
            "measured_peak_activation_bytes": list(self.measured_activation_bytes),
            "predicted_peak_memory_bytes": list(self.predicted_memory_bytes),
            "measured_peak_memory_bytes": list(self.measured_memory_bytes),  # the allocator's
            "memory_error": self.memory_error,
            "measured_over_predicted_action_time": dict(self.slowdown),
        }


def _timed(steps: Sequence[float], run_lengths: Sequence[int]) -> list[float]:
    """Leave out the first step of each run (warm-up) where the run has more than one."""
    timed, start = [], 0
    for length in run_lengths or (len(steps),):
        chunk = list(steps[start : start + length])
        timed += chunk[1:] if len(chunk) > 1 else chunk
        start += length
    return timed


def compare(
    plan: plan_pb2.Plan,
    profile: profile_pb2.Profile,
    runs: Sequence[RunResult],
    *,
    costs: CostModel | None = None,
) -> Comparison:
    """Predicted (the simulator with ``costs``, default ``local_cost_model(plan, profile)``) vs measured
    (``runs`` of ``plan``)."""
    if not runs:
        raise ValueError("give at least one run of the plan to compare with")
    costs = costs if costs is not None else local_cost_model(plan, profile)
    # a comparison, not a verification: a cap the plan carries is reported (Estimate.fits), never raised
    unchecked = SimulationConfig(enforce_memory_caps=False)
    simulation = simulate(plan, costs, config=unchecked)
    per_run = [measured_step_times_us(run) for run in runs]
    steps = [t for times in per_run for t in times]
    lengths = tuple(len(times) for times in per_run)
    timelines = [t for run in runs for t in timelines_to_proto(run) if t.step > 0 or len(run.losses) == 1]
    durations = durations_from_timelines(timelines)
    replay = simulate(plan, dataclasses.replace(costs, durations_us=durations), config=unchecked)
    sums: dict[str, list[float]] = {}
    for (stage, kind), measured_us in durations.items():
        group = {"F": "F", "I": "I+W", "W": "I+W", "B": "B"}.get(kind.code)
        if group is not None and stage < len(costs.stages):
            pair = sums.setdefault(group, [0.0, 0.0])
            pair[0] += measured_us
            pair[1] += costs.stages[stage].duration_us(kind)
    held: dict[int, int] = {}
    for timeline in timelines:
        held[timeline.rank] = max(held.get(timeline.rank, 0), int(timeline.peak_memory_bytes))
    measured = [run.memory for run in runs if run.memory]
    allocator = (
        tuple(max(int(m[r]["peak_bytes"]) for m in measured) for r in range(len(plan.ranks))) if measured else ()
    )
    return Comparison(
        plan_name=plan.name,
        simulation=simulation,
        measured_steps_us=tuple(steps),
        measured_step_us=statistics.median(_timed(steps, lengths)),
        replay_step_us=replay.estimate.step_time_us,
        measured_activation_bytes=tuple(held.get(r, 0) for r in range(len(plan.ranks))),
        allocator_memory_bytes=allocator,
        run_lengths=lengths,
        slowdown={group: m / p for group, (m, p) in sums.items() if p > 0},
    )


@dataclasses.dataclass(frozen=True)
class InSitu:
    """A profile calibrated in situ: per-layer action times and what a message of the pipelined run costs."""

    profile: profile_pb2.Profile
    #: stage of the first calibration plan -> measured / profiled per kind (simulate.Calibration.factors)
    factors: dict[int, dict[str, float]]
    #: the link latency each calibration run implies, within the probe's bounds (``simulate.fit_message_costs``),
    #: and their median
    latencies_us: tuple[float, ...]
    latency_us: float
    #: per run, every fitted term with its bounds (receive CPU per message, link latency)
    fitted: tuple[tuple[FittedTerm, ...], ...] = ()
    #: the median over runs of the fitted receive CPU per message
    receive_cpu_us: float = 0.0


def calibrate_in_situ(profile: profile_pb2.Profile, runs: Sequence[tuple[plan_pb2.Plan, RunResult]]) -> InSitu:
    """Calibrate ``profile`` with a short run of a few plans (same stages; e.g. 1F1B and ZB-H1).

    Layer times: ``simulate.calibrate_profile`` on every run's timelines
    (warm-up steps left out). Messages: the median over runs of what a message
    costs beyond the profile's, with which the simulator, fed those times,
    reproduces the run's median step (``simulate.fit_message_costs``): the
    runtime's CPU work per message on the receiving end (on CPU ranks a
    message waits for its channel thread to get the busy core) within its
    physical bounds, and only past them the link's latency, within 2x of the
    probed link's. The profile keeps both (``links``, ``runtime``); every fit
    is reported with its bounds (``InSitu.fitted``). The same calibration
    serves the tuner, the demo and the closed loop.
    """
    if not runs:
        raise ValueError("give at least one (plan, run) to calibrate with")
    stages = [tuple(s.layer_names) for s in runs[0][0].stages]
    if any([tuple(s.layer_names) for s in plan.stages] != stages for plan, _ in runs):
        raise ValueError("calibration runs must share their stages (e.g. 1F1B and ZB-H1 on the same partition)")
    timelines = [t for _, run in runs for t in timelines_to_proto(run) if t.step > 0 or len(run.losses) == 1]
    calibration = calibrate_profile(profile, runs[0][0], timelines)
    probe = local_link(profile)  # the profile's probed link, else the local gloo link's
    fitted = tuple(
        fit_message_costs(plan, local_cost_model(plan, calibration.profile), median_step_time_us(run), probe=probe)
        for plan, run in runs
    )
    latencies = tuple(latency.value for _, latency in fitted)
    latency = statistics.median(latencies)
    receive = statistics.median(term.value for term, _ in fitted)
    calibrated = calibration.profile
    runtime = RuntimeCosts.from_proto(calibrated.runtime) if calibrated.HasField("runtime") else RuntimeCosts()
    runtime = dataclasses.replace(runtime, recv_cpu=dataclasses.replace(runtime.recv_cpu, fixed_us=receive))
    calibrated.runtime.CopyFrom(runtime.to_proto(source=calibrated.runtime.source or "calibrated in situ"))
    bandwidth = probe.bandwidth_bytes_per_second
    del calibrated.links[:]
    ranks = len(runs[0][0].ranks)
    calibrated.links.extend(
        profile_pb2.LinkCost(
            source_rank=a, destination_rank=b, latency_us=latency, bandwidth_bytes_per_second=bandwidth
        )
        for a in range(ranks)
        for b in range(ranks)
        if a != b
    )
    calibrated.labels["calibrated_in_situ"] = ",".join(plan.name for plan, _ in runs)
    return InSitu(
        profile=calibrated,
        factors=calibration.factors,
        latencies_us=latencies,
        latency_us=latency,
        fitted=fitted,
        receive_cpu_us=receive,
    )
