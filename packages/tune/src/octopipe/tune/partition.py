"""The baseline partition of shared/benchmarks.md: equal layer counts per stage."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["equal_partition"]


def equal_partition(layer_names: Sequence[str], num_stages: int) -> list[list[str]]:
    """Split ``layer_names`` (embedding first, head last) into ``num_stages`` stages.

    The layers between the first and the last are dealt out in order, equal
    counts per stage (the first stages take one more when they do not divide);
    the embedding joins the first stage and the head the last, as in
    shared/benchmarks.md's baseline.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    body = list(layer_names[1:-1])
    if len(layer_names) < 2 or len(body) < num_stages:
        raise ValueError(
            f"{len(body)} layers between the first and the last cannot fill {num_stages} stages: use fewer stages"
        )
    size, extra = divmod(len(body), num_stages)
    stages: list[list[str]] = []
    start = 0
    for index in range(num_stages):
        end = start + size + (1 if index < extra else 0)
        stages.append(body[start:end])
        start = end
    stages[0].insert(0, layer_names[0])
    stages[-1].append(layer_names[-1])
    return stages
