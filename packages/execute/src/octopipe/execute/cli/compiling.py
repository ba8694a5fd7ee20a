"""The ``--compile`` option that ``run``, ``train`` and ``demo`` share, and the one line that says what ran.

``auto`` (the default) runs a stage's graphs compiled where octopipe's compile
index has seen them all on this machine (Inductor's cache is warm) and they ran
faster compiled, and runs the rest as captured (``transform.compile_cache``): a
cold cache never makes a run slower than eager. ``inductor`` compiles
everything (paying Inductor's compile time once; it also fills the index),
``eager`` runs the captured graphs as they are (bitwise equal to the model's
own eager training).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from octopipe.execute.runs import STAGE_BACKENDS

__all__ = ["add_compile_argument", "compile_line"]


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        choices=STAGE_BACKENDS,
        default="auto",
        help="how the stage graphs run (default: auto): auto compiles them where the compile cache is warm and "
        "compiled runs faster, else runs them as captured; inductor compiles every graph (and fills the cache); "
        "eager runs them as captured (bitwise equal to the model's own training)",
    )


def compile_line(chosen: str, notes: Mapping[int, str]) -> str:
    """One line: what ran compiled under ``--compile chosen``, stage by stage, and how to opt out."""
    if chosen == "eager":
        return "stage graphs: as captured (--compile eager)"
    stages = "; ".join(notes[s] for s in sorted(notes)) or "no stage reported"
    tail = "--compile eager runs them as captured"
    if chosen == "auto" and "cache cold" in stages:
        tail += "; --compile inductor compiles every graph once and fills the cache"
    return f"stage graphs (--compile {chosen}): {stages}. {tail}"
