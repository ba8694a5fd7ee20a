"""What a run is told and what it reports, without torch: the caller's :class:`RunOptions`, each rank's
:class:`WorkerConfig`, the :class:`RunResult` (or :class:`RunFailed`), the keys ranks share in their
rendezvous store, and the rule for switching plans mid-run.

The CLI, the control plane and the launcher build these; only rank processes
(``runtime.worker``) import torch. Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from octopipe.plan.v1 import plan_pb2

if TYPE_CHECKING:
    import torch

__all__ = [
    "ABORT_KEY",
    "PLAN_KEY",
    "WORKLOAD_SOURCE",
    "RunFailed",
    "RunOptions",
    "RunResult",
    "WorkerConfig",
    "same_layout",
]

#: a Plan's ``model.source`` for the built-in workloads (``octopipe.examples``); every daemon allows it
WORKLOAD_SOURCE = "octopipe.examples:workload"

#: set in the run's store by whoever sees a failure first; every rank leaves its waits when it appears
ABORT_KEY = "octopipe/abort"
#: ``<PLAN_KEY>/<n>``: the n-th plan an adaptive run switches to (``runtime.worker.publish_plan``)
PLAN_KEY = "octopipe/plan"


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """How ``runtime.run_local`` / ``run_local_many`` run plans on local CPU ranks (gloo, 127.0.0.1).

    ``steps`` optimizer steps each, from weights built with ``seed``; every wait of a rank gives up after
    ``timeout_s``. With ``pin_cores`` rank r runs on ``cpus[r % len(cpus)]`` (default: the machine's
    online CPUs, whatever mask this process has); ranks that must share cores are a warning, or a
    ValueError with ``strict_pinning``. ``keep_grads`` / ``keep_params`` return the first step's
    gradients and the final parameters. ``fail_at`` maps a rank to (step, action index) where it raises
    (fault tests). ``checkpoint_dir`` / ``checkpoint_every`` save checkpoints (``runtime.checkpoint``);
    ``start_step`` with ``resume`` continues from ``checkpoint_dir/step-<start_step>``.
    ``numerics_check`` (whole-model capture): before the first step every rank checks that its stages
    reproduce the model's own forward on one micro-batch and refuses to train, naming the stage, if not.
    ``measure_memory`` runs one more pipeline step (no update) after the timed ones under the allocator
    meter (``RunResult.memory``).
    """

    steps: int = 1
    seed: int = 0
    timeout_s: float = 60.0
    learning_rate: float = 1e-3
    pin_cores: bool = True
    cpus: Sequence[int] = ()
    strict_pinning: bool = False
    keep_grads: bool = False
    keep_params: bool = False
    fail_at: dict[int, tuple[int, int]] = field(default_factory=dict)
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    start_step: int = 0
    resume: bool = False
    numerics_check: bool = True
    measure_memory: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", tuple(self.cpus))  # a list given by a caller becomes a tuple
        problems = []
        if self.steps < 1:
            problems.append(f"steps must be >= 1, got {self.steps}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if any(c < 0 for c in self.cpus):
            problems.append(f"cpus must be core numbers >= 0, got {list(self.cpus)}")
        if self.checkpoint_every < 0 or self.start_step < 0:
            problems.append("checkpoint_every and start_step must be >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            problems.append("checkpoint_every needs a checkpoint_dir")
        if self.resume and not self.checkpoint_dir:
            problems.append("resume needs the checkpoint_dir to resume from")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(kw_only=True, frozen=True)
class WorkerConfig:
    """One rank process's orders: the plans (serialized), where the store is, and how to run."""

    plans: tuple[bytes, ...]
    rank: int
    world_size: int
    store_host: str
    store_port: int
    #: host the rendezvous store here (rank 0 of a launch without a launcher-held store)
    store_is_master: bool = False
    result_dir: str
    steps: int = 1
    seed: int = 0
    timeout_s: float = 60.0
    learning_rate: float = 1e-3
    pin_cores: bool = True
    #: the cores rank r chooses from (``cpus[r % len(cpus)]``); empty: the machine's online CPUs
    cpus: tuple[int, ...] = ()
    keep_grads: bool = False
    keep_params: bool = False
    fail_at: tuple[int, int] | None = None  # (step, action index): raise there, for fault tests
    #: the first step's index (a resumed run starts after its checkpoint); ``steps`` steps run from here
    start_step: int = 0
    #: checkpoints (see runtime.checkpoint) go here every ``checkpoint_every`` completed steps
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    #: load ``checkpoint_dir/step-<start_step>`` before the first step
    resume: bool = False
    #: Linux: the kernel kills this rank when the process that started it dies (a node daemon's ranks)
    die_with_parent: bool = False
    #: at every step boundary, take a newer plan from the store if one was published (``publish_plan``)
    adaptive: bool = False
    #: whole-model capture: check before the first step that the pipelined forward reproduces the model's loss
    numerics_check: bool = True
    #: after the timed steps, one more pipeline step (no optimizer update) under the allocator meter
    #: (runtime.memory); its result is each plan's ``memory``
    measure_memory: bool = False


class RunFailed(RuntimeError):
    """A rank failed; the message is the first failure's, naming rank, step and action."""


@dataclass
class RunResult:
    """What the ranks reported: per-step losses (from the last stage), first-step grads, final params, timelines."""

    losses: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: rank -> per step {"start_ns", "end_ns", "records": [ActionRecord fields]}
    timelines: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: rank -> channel ("send <peer>" or "recv <peer>") -> its transfers in the order they started, every step
    channels: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    #: rank -> the cores it ran on (one each when pinned)
    cores: dict[int, list[int]] = field(default_factory=dict)
    #: rank -> the numerics guard's figures (reference and pipelined loss, seconds) for a whole-model capture
    numerics: dict[int, dict[str, float]] = field(default_factory=dict)
    #: rank -> each copy it holds of a tied parameter: first-step gradient and (``keep_params``) final value
    tied_grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    tied_params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: rank -> the allocator-measured memory of one extra step (``measure_memory=True``; runtime.memory)
    memory: dict[int, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0


def same_layout(old: plan_pb2.Plan, new: plan_pb2.Plan) -> str:
    """Why ``new`` cannot replace ``old`` in a running job ('' when only the schedule differs)."""
    if [(tuple(s.layer_names), s.rank) for s in old.stages] != [(tuple(s.layer_names), s.rank) for s in new.stages]:
        return "its stages or their placement differ"
    if old.num_microbatches != new.num_microbatches or len(old.ranks) != len(new.ranks):
        return "its micro-batch or rank count differs"
    if old.mesh.SerializeToString(deterministic=True) != new.mesh.SerializeToString(deterministic=True):
        return "its mesh differs"
    return ""
