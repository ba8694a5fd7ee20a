"""No import circle inside any package: every import counts, including ones inside functions.

A circle hidden behind a function-level import still ties two modules into one
unit (neither can be read, tested or moved alone); the fix is to move what both
need into a third module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.layout import DISTRIBUTIONS, PACKAGES, package_sources
from tests.repo.test_layering import imported_modules


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(DISTRIBUTIONS[package] / "src").with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (``__init__`` re-exports left out)."""
    modules = {module_name(package, path): path for path in package_sources(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue  # a package's __init__ imports its modules to re-export them; that is not a circle
        targets = set()
        for imported in imported_modules(path):
            # `from a.b import c` names a.b and a.b.c: keep the longest that is one of our modules
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and modules[imported].name != "__init__.py":
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (its modules, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package: str) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle == [], "import circle: " + " -> ".join(cycle)


def test_the_check_finds_a_circle_hidden_in_a_function() -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set()}) == []
