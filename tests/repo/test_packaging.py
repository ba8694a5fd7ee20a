"""Every distribution is complete and declares exactly the dependencies it imports."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib

import pytest

from tests.repo.layout import DISTRIBUTIONS, PACKAGES, ROOT, package_sources
from tests.repo.test_layering import PROTO_AREAS, imported_modules

# Top-level import name -> distribution name, for third-party code.
IMPORT_TO_DIST = {
    "google": "protobuf",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "cryptography": "cryptography",
    "torch": "torch",
    "structlog": "structlog",
    "rich": "rich",
    "matplotlib": "matplotlib",
    "highspy": "highspy",
    "safetensors": "safetensors",
    "transformers": "transformers",
    "tensorboardX": "tensorboardx",
}


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def declared(package: str) -> set[str]:
    """The required dependencies."""
    data = tomllib.loads((DISTRIBUTIONS[package] / "pyproject.toml").read_text())
    return {requirement_name(r) for r in data["project"].get("dependencies", [])}


def extras(package: str) -> set[str]:
    """The optional dependencies (every extra): what code may import lazily, when a feature is used."""
    data = tomllib.loads((DISTRIBUTIONS[package] / "pyproject.toml").read_text())
    groups = data["project"].get("optional-dependencies", {})
    return {requirement_name(r) for group in groups.values() for r in group}


def used(package: str) -> set[str]:
    dists = set()
    for path in package_sources(package):
        for module in imported_modules(path):
            top = module.split(".")[0]
            parts = module.split(".")
            if top == "octopipe" and len(parts) > 1:
                name = "protos" if parts[1] in PROTO_AREAS else parts[1]
                if name != package:
                    dists.add(f"octopipe-{name}")
            elif top not in sys.stdlib_module_names and top != "__future__":
                assert top in IMPORT_TO_DIST, f"{path}: add {top!r} to IMPORT_TO_DIST"
                dists.add(IMPORT_TO_DIST[top])
    return dists


@pytest.mark.parametrize("package", PACKAGES)
def test_declares_exactly_what_it_imports(package: str) -> None:
    imported = used(package)
    assert declared(package) <= imported, "a required dependency that nothing imports: drop it"
    assert imported <= declared(package) | extras(package), "an import that no dependency or extra declares"
    assert not declared(package) & extras(package), "a dependency is both required and optional"


def test_extras_count_only_for_optional_imports() -> None:
    """Extras satisfy imports (a lazily imported matplotlib); required dependencies must still be imported."""
    assert "matplotlib" in extras("simulate")
    assert "matplotlib" in used("simulate")
    assert "matplotlib" not in declared("simulate")


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_distribution_is_complete(dist: str) -> None:
    folder = DISTRIBUTIONS[dist]
    data = tomllib.loads((folder / "pyproject.toml").read_text())
    assert data["project"]["name"] == f"octopipe-{dist}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", data["project"]["version"])
    assert data["project"]["requires-python"] == ">=3.11"
    for doc in ("README.md", "CHANGELOG.md"):
        text = (folder / doc).read_text()
        assert len(text.splitlines()) > 3, f"{folder / doc} is empty"
    assert data["project"]["version"] in (folder / "CHANGELOG.md").read_text()
    if dist != "protos":  # the protos' markers are generated with their code
        assert (folder / "src" / "octopipe" / dist / "py.typed").is_file()


@pytest.mark.parametrize("package", PACKAGES)
def test_curated_all(package: str) -> None:
    module = importlib.import_module(f"octopipe.{package}")
    exported = module.__all__  # ruff's RUF022 keeps it sorted
    assert len(set(exported)) == len(exported)
    assert "__version__" in exported
    for name in exported:
        assert hasattr(module, name), f"octopipe.{package}.__all__ names missing {name}"


def test_simulate_and_tune_import_without_torch() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import octopipe.simulate, octopipe.tune, octopipe.plan.v1.plan_pb2\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
