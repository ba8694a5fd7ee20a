"""``--json`` output: one JSON document on stdout, the same shapes in every command."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from octopipe.simulate import Estimate

__all__ = ["dumps", "estimate_json", "print_json"]


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(document: Any) -> str:
    """``document`` as indented JSON (NaN and infinity as null) and a newline."""
    return json.dumps(_finite(document), indent=2) + "\n"


def print_json(document: Any) -> None:
    """Write ``document`` to stdout as JSON (see :func:`dumps`)."""
    sys.stdout.write(dumps(document))


def estimate_json(estimate: Estimate) -> dict[str, Any]:
    """The simulator's prediction for one step: times in microseconds, memory in bytes per rank."""
    return {
        "plan": estimate.plan_name,
        "step_time_us": estimate.step_time_us,
        "samples_per_second": estimate.samples_per_second,
        "bubble_ratio": estimate.bubble_ratio,
        "communication_overlap_ratio": estimate.communication_overlap_ratio,
        "peak_memory_bytes": [r.peak_memory_bytes for r in estimate.ranks],
        "peak_activation_bytes": [r.peak_activation_bytes for r in estimate.ranks],
        "memory_cap_bytes": [r.memory_cap_bytes for r in estimate.ranks],
        "fits": estimate.fits,
    }
