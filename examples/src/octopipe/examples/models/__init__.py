"""The zoo: small decoders for tests and benchmarks (see shared/benchmarks.md)."""

from octopipe.examples.models.blocks import Attention, SquaredReluMLP, SwiGLU
from octopipe.examples.models.decoder import (
    NEMOTRON_H_8B,
    NEMOTRON_H_56B,
    Block,
    DecoderLM,
    Head,
    ModelConfig,
    jamba,
    jamba_kinds,
    llama,
    moe_decoder,
    nemotron_h,
    nemotron_h_kinds,
)
from octopipe.examples.models.expert_parallel import ExpertParallelMoE, expert_parallel
from octopipe.examples.models.mamba import Mamba
from octopipe.examples.models.moe import MoE

__all__ = [
    "NEMOTRON_H_8B",
    "NEMOTRON_H_56B",
    "Attention",
    "Block",
    "DecoderLM",
    "ExpertParallelMoE",
    "Head",
    "Mamba",
    "MoE",
    "ModelConfig",
    "SquaredReluMLP",
    "SwiGLU",
    "expert_parallel",
    "jamba",
    "jamba_kinds",
    "llama",
    "moe_decoder",
    "nemotron_h",
    "nemotron_h_kinds",
]
