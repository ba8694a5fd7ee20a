"""Where the monorepo's distributions live, for the repository-level tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the code packages, bottom layer first; ``examples`` is the model zoo
PACKAGES = ("ir", "examples", "capture", "transform", "simulate", "tune", "execute")
DISTRIBUTIONS = {
    "protos": ROOT / "protos",
    "examples": ROOT / "examples",
    **{name: ROOT / "packages" / name for name in PACKAGES if name != "examples"},
}


def package_sources(package: str) -> list[Path]:
    return sorted((DISTRIBUTIONS[package] / "src" / "octopipe" / package).rglob("*.py"))
