"""shared/benchmarks.md's standard executed workloads, by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from octopipe.examples.models import DecoderLM, ModelConfig, jamba, llama, moe_decoder, nemotron_h

__all__ = ["WORKLOADS", "Workload", "workload"]


@dataclass(kw_only=True, frozen=True)
class Workload:
    """A model and the batch it trains on."""

    name: str
    build: Callable[[ModelConfig], DecoderLM]
    config: ModelConfig = field(default_factory=ModelConfig)
    sequence: int = 128
    global_batch: int = 32
    microbatches: int = 8

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // self.microbatches

    def model(self, *, seed: int = 0) -> DecoderLM:
        torch.manual_seed(seed)
        return self.build(self.config)

    def batch(self, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random tokens and next-token targets for one global batch."""
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab, (self.global_batch, self.sequence + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(name="llama-8", build=lambda c: llama(8, c)),
        Workload(name="jamba-8", build=lambda c: jamba(8, c)),
        Workload(name="nemotronh-16", build=lambda c: nemotron_h("M-M-M-M*-M-M-M-M", c)),
        Workload(name="moe-ep-4", build=lambda c: moe_decoder(4, c)),
    )
}


def workload(name: str) -> Workload:
    """The standard workload ``name`` (llama-8, jamba-8, nemotronh-16, moe-ep-4)."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(sorted(WORKLOADS))}") from None
