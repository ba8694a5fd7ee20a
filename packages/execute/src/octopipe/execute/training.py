"""What the optimizer does each step, without torch: the optimizer, weight-decay groups, the learning-rate
schedule and global gradient-norm clipping (``runtime.optim`` applies it on every rank and in the eager
reference alike, so a pipelined run and the single process step the same way).

``Optimization()`` is torch's AdamW at a constant learning rate of 1e-3 (weight decay 0.01 on every
parameter), what a run did before there was a choice. A training job's usual choices::

    Optimization(learning_rate=3e-4, weight_decay=0.1, decay_norms_and_biases=False,
                 warmup_steps=100, schedule="cosine", total_steps=10_000, min_lr_ratio=0.1,
                 clip_grad_norm=1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["OPTIMIZERS", "SCHEDULES", "DataSpec", "Optimization", "WeightsSpec"]

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class Optimization:
    """The optimizer and its schedule (see the module docstring).

    ``decay_norms_and_biases=False`` puts 1-D parameters (norm weights, biases) in a group without weight
    decay. The learning rate at step s (0-based): ``learning_rate * (s + 1) / warmup_steps`` during the
    warm-up, then ``constant``, or decaying ``linear``-ly or by a ``cosine`` to ``min_lr_ratio *
    learning_rate`` at ``total_steps`` (and staying there). ``clip_grad_norm > 0`` scales every gradient
    by ``min(1, clip / (norm + 1e-6))`` where ``norm`` is the 2-norm of all of the model's gradients, over
    every stage and replica, as ``torch.nn.utils.clip_grad_norm_`` computes it on the single process.
    """

    optimizer: Literal["adamw", "sgd"] = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    #: AdamW's betas
    betas: tuple[float, float] = (0.9, 0.999)
    #: SGD's momentum
    momentum: float = 0.0
    decay_norms_and_biases: bool = True
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        problems = []
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0 or self.momentum < 0 or self.clip_grad_norm < 0:
            problems.append("weight_decay, momentum and clip_grad_norm must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            problems.append("warmup_steps and total_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            problems.append(
                f"a {self.schedule} schedule decays from the end of the warm-up ({self.warmup_steps} steps) to "
                f"total_steps ({self.total_steps}): make total_steps larger than warmup_steps"
            )
        if problems:
            raise ValueError("; ".join(problems))

    def decays(self, ndim: int) -> bool:
        """Whether a parameter of ``ndim`` dimensions gets weight decay."""
        return self.decay_norms_and_biases or ndim >= 2

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based; a resumed run continues the schedule)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.learning_rate
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        left = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.learning_rate * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * left)


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where a run's batches come from instead of the model's own: text ``files`` read as bytes (token ids
    0-255; none: the Python standard library's source, up to ``max_bytes``), packed into rows of the model's
    sequence length + 1 and drawn per step from ``seed`` (``runtime.data.ByteCorpus``). The global batch
    and sequence are the model's (``batch(0)``'s shape), so the plan's micro-batches are unchanged."""

    files: tuple[str, ...] = ()
    seed: int = 0
    max_bytes: int = 4 << 20
    #: a transformers tokenizer (folder, or hub id in the local cache) instead of bytes
    tokenizer: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(str(f) for f in self.files))
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")


@dataclass(frozen=True, kw_only=True)
class WeightsSpec:
    """Where a run's initial weights come from, and where its trained weights go.

    ``load``: a folder of safetensors in HuggingFace's layout (``model.safetensors``, or shards named by
    ``model.safetensors.index.json``) or one of octopipe's checkpoints (a ``step-<n>`` folder). The ranks
    then build the model with its parameters on the meta device and each reads only its own stages'
    tensors (``runtime.pretrained``); a parameter the files lack is refused, not left at random.
    ``export``: a folder the trained weights are written to in the same HF layout (a shard per rank and
    an index; the source folder's ``config.json`` and tokenizer files copied), so ``transformers``'
    ``from_pretrained`` reads them back.
    """

    load: str = ""
    export: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.load, str) or not isinstance(self.export, str):
            raise ValueError(f"load and export are folder paths, got {self.load!r} and {self.export!r}")
