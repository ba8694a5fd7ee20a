"""Small Profile builders, for tests, examples and what-if studies."""

from __future__ import annotations

import math
from collections.abc import Sequence

from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2

__all__ = ["uniform_profile"]


def uniform_profile(
    layer_names: Sequence[str] | plan_pb2.Plan,
    *,
    num_ranks: int | None = None,
    forward_us: float = 1.0,
    backward_input_us: float = 1.0,
    backward_weight_us: float = 1.0,
    activation_bytes: int = 0,
    freed_by_backward_input_bytes: int = 0,
    parameter_bytes: int = 0,
    gradient_bytes: int = 0,
    optimizer_state_bytes: int = 0,
    output_bytes: int = 0,
    latency_us: float = 0.0,
    bandwidth_bytes_per_second: float = math.inf,
    microbatch_size: int = 1,
) -> profile_pb2.Profile:
    """A Profile in which every layer costs the same and every pair of ranks has the same link.

    ``layer_names`` are the layers to cost, or a Plan whose stages name them
    (its rank count is then the default for ``num_ranks``). Links are added for
    every ordered pair of the ``num_ranks`` ranks. The defaults (1 us each for
    F, I and W, no bytes, free links) are the unit-time model of the closed forms.
    """
    if isinstance(layer_names, plan_pb2.Plan):
        names = [name for stage in layer_names.stages for name in stage.layer_names]
        ranks = len(layer_names.ranks) if num_ranks is None else num_ranks
    else:
        names = list(layer_names)
        ranks = 1 if num_ranks is None else num_ranks
    if not names:
        raise ValueError("no layer names: pass the layers to cost, or a plan whose stages name its layers")
    if ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {ranks}")
    if not 0 <= freed_by_backward_input_bytes <= activation_bytes:
        raise ValueError("freed_by_backward_input_bytes must be between 0 and activation_bytes")
    profile = profile_pb2.Profile(device="uniform", microbatch_size=microbatch_size)
    profile.labels["builder"] = "octopipe.simulate.uniform_profile"
    for name in names:
        layer = profile.layers.add(
            layer_name=name,
            layer_type="uniform",
            forward_duration_us=forward_us,
            backward_input_duration_us=backward_input_us,
            backward_weight_duration_us=backward_weight_us,
            activation_saved_bytes=activation_bytes,
            activation_freed_by_backward_input_bytes=freed_by_backward_input_bytes,
            activation_freed_by_backward_weight_bytes=activation_bytes - freed_by_backward_input_bytes,
            parameter_bytes=parameter_bytes,
            gradient_bytes=gradient_bytes,
            optimizer_state_bytes=optimizer_state_bytes,
        )
        if output_bytes:
            layer.output_tensors.add(shape=[output_bytes], dtype="uint8", size_bytes=output_bytes)
    for source in range(ranks):
        for destination in range(ranks):
            if source != destination:
                profile.links.add(
                    source_rank=source,
                    destination_rank=destination,
                    latency_us=latency_us,
                    bandwidth_bytes_per_second=bandwidth_bytes_per_second,
                )
    return profile
