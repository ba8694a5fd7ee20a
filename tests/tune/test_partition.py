"""The baseline partition: equal layer counts, embedding first, head last."""

from __future__ import annotations

import pytest

from octopipe.tune import equal_partition


def test_equal_counts_with_embedding_and_head_at_the_ends() -> None:
    names = ["embed", *[f"layers.{i}" for i in range(7)], "head"]
    stages = equal_partition(names, 3)
    assert stages == [
        ["embed", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "layers.6", "head"],
    ]
    assert [n for s in stages for n in s] == names
    assert equal_partition(names, 1) == [names]


def test_too_many_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="2 layers between the first and the last cannot fill 3 stages"):
        equal_partition(["embed", "a", "b", "head"], 3)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        equal_partition(["embed", "a", "head"], 0)
