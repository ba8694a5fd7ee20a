"""The layering of shared/design.md, enforced on the import graph of the sources.

Imports only go down; simulate and tune never import torch. Every import in a
module counts, including ones inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests.repo.layout import PACKAGES, ROOT, package_sources

# What each package may import from octopipe (besides itself).
ALLOWED: dict[str, set[str]] = {
    "ir": {"protos"},
    "examples": set(),
    "capture": {"protos"},
    "simulate": {"protos", "ir"},
    "transform": {"protos", "capture"},
    "tune": {"protos", "ir", "simulate"},
    "execute": {"protos", "ir", "examples", "capture", "transform", "simulate", "tune"},
}
TORCH_FREE = {"ir", "simulate", "tune"}
PROTO_AREAS = {"plan", "profile", "estimate", "coordinator", "node"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def octopipe_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "octopipe" or len(parts) < 2:
        return None
    return "protos" if parts[1] in PROTO_AREAS else parts[1]


def violations(package: str) -> list[str]:
    found = []
    for path in package_sources(package):
        for module in sorted(imported_modules(path)):
            layer = octopipe_layer(module)
            rel = path.relative_to(ROOT)
            if layer is not None and layer != package and layer not in ALLOWED[package]:
                found.append(f"{rel}: imports {module} ({package} may not import {layer})")
            if package in TORCH_FREE and module.split(".")[0] in {"torch", "functorch"}:
                found.append(f"{rel}: imports {module} ({package} must not import torch)")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_only_go_down(package: str) -> None:
    assert violations(package) == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom octopipe.execute.cli import main\nfrom octopipe.plan.v1 import plan_pb2\n")
    modules = imported_modules(bad)
    layers = {octopipe_layer(m) for m in modules}
    assert "torch" in modules
    assert layers == {None, "execute", "protos"}
    assert "execute" not in ALLOWED["simulate"]


def test_no_namespace_init_anywhere() -> None:
    skipped = {".venv", ".pants-venv", ".pants.d", ".git", "dist", "node_modules", "__pycache__"}
    offenders = []
    for folder, subfolders, files in os.walk(ROOT):  # pruned: the virtualenvs hold tens of thousands of files
        subfolders[:] = [s for s in subfolders if s not in skipped and not s.startswith(".pants")]
        if Path(folder).name == "octopipe" and "__init__.py" in files:
            offenders.append(Path(folder) / "__init__.py")
    assert offenders == [], "octopipe is a PEP 420 namespace: remove these files"
