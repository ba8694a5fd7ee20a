"""What octopipe knows about compiling each graph: whether Inductor has it cached, and whether it is faster.

``backend="auto"`` (the default of ``octopipe run``, ``train`` and ``demo``) runs a
stage's graphs compiled only where this index says two things about every one
of them: it was compiled on this machine before (so Inductor's on-disk cache
holds it and compiling again takes seconds, not minutes), and its compiled code
ran faster than the captured graph. A stage with any graph the index has not
seen runs eagerly as captured: a cold cache never makes a run slower than eager.
Compiling with ``backend="inductor"`` fills the index: after compiling a graph
it times the compiled and the eager graph on the example inputs (the median of
a few runs each, the same thread) and records both.

An entry is keyed by what decides the compiled code: the graph's generated
Python code, every input's shape, stride, dtype and device, and torch's
version. It lives in one small JSON file per graph under the index folder
(``OCTOPIPE_COMPILE_INDEX``, default ``~/.cache/octopipe/compile/index``);
writes are atomic, so ranks compiling at once never see half an entry. Inductor's
own cache goes beside it (``TORCHINDUCTOR_CACHE_DIR``, default
``~/.cache/octopipe/compile/inductor``, set by the process entry points unless
the user set it), so deleting ``~/.cache/octopipe/compile`` forgets both.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

__all__ = [
    "CompileIndex",
    "GraphTiming",
    "default_compile_root",
    "graph_key",
    "time_graphs",
    "use_compile_cache_dirs",
]

#: compiled code is used only where it ran at most this fraction of the eager graph's time (noise margin)
FASTER = 0.95


def default_compile_root() -> Path:
    """``~/.cache/octopipe/compile`` (``XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "octopipe" / "compile"


def use_compile_cache_dirs() -> None:
    """Point Inductor's on-disk cache beside the index unless the user chose a folder (a process entry point
    calls it once, before anything compiles)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_compile_root() / "inductor"))


def graph_key(graph: fx.GraphModule) -> str:
    """What decides a graph's compiled code, hashed: its code, its inputs' layouts and devices, torch."""
    parts = [graph.code, torch.__version__]
    for node in graph.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else [value]
        for v in values:
            if isinstance(v, torch.Tensor):
                parts.append(f"{tuple(v.shape)}/{v.stride()}/{v.dtype}/{v.device}")
            else:
                parts.append(repr(type(v)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class GraphTiming:
    """One graph's entry: what it is, compiled and eager time on its example inputs, how long compiling took."""

    what: str
    eager_us: float
    compiled_us: float
    compile_s: float
    torch: str

    @property
    def faster(self) -> bool:
        return self.compiled_us <= FASTER * self.eager_us


def time_graphs(
    eager: Callable[..., Any], compiled: Callable[..., Any], inputs: list[Any], repeats: int = 3
) -> tuple[float, float]:
    """Median microseconds of ``eager`` and ``compiled`` on ``inputs`` (interleaved, after one warm-up each)."""
    samples: dict[str, list[float]] = {"eager": [], "compiled": []}
    with torch.no_grad():
        for index in range(repeats + 1):
            for name, fn in (("eager", eager), ("compiled", compiled)):
                start = time.perf_counter_ns()
                fn(*inputs)
                if index:
                    samples[name].append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples["eager"]), statistics.median(samples["compiled"])


class CompileIndex:
    """The index folder (see the module docstring); ``folder`` default from ``OCTOPIPE_COMPILE_INDEX``."""

    def __init__(self, folder: Path | str | None = None) -> None:
        chosen = folder or os.environ.get("OCTOPIPE_COMPILE_INDEX") or default_compile_root() / "index"
        self.folder = Path(chosen)

    def get(self, key: str) -> GraphTiming | None:
        path = self.folder / f"{key}.json"
        try:
            data = json.loads(path.read_text())
            return GraphTiming(**data)
        except (OSError, ValueError, TypeError):
            return None

    def put(self, key: str, timing: GraphTiming) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        with os.fdopen(handle, "w") as out:
            json.dump(asdict(timing), out)
        os.replace(temporary, self.folder / f"{key}.json")
