"""Where the monorepo's packages live, for the repository-level tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("capture", "transform", "simulate", "tune", "execute")
DISTRIBUTIONS = {"protos": ROOT / "protos", **{name: ROOT / "packages" / name for name in PACKAGES}}


def package_sources(package: str) -> list[Path]:
    return sorted((ROOT / "packages" / package / "src" / "octopipe" / package).rglob("*.py"))
