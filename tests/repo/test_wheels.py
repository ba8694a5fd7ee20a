"""Every wheel builds; installed into separate directories they still form one namespace.

This is how PEP 420 namespace packaging breaks in practice: a stray
octopipe/__init__.py, or a wheel that ships the namespace folder's contents,
shadows the others. Each wheel is built from a copy of its folder (as pip would
from an sdist), installed with pip into its own --target, and the six
directories are then put on sys.path of a fresh interpreter with no site
processing, so the development install cannot help.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.repo.layout import DISTRIBUTIONS

pytestmark = pytest.mark.slow
IGNORE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*_pb2*.py", "*_pb2*.pyi", "py.typed")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wheels")
    built = {}
    for name, folder in DISTRIBUTIONS.items():
        source = root / "src" / name
        shutil.copytree(
            folder,
            source,
            ignore=IGNORE if name == "protos" else shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
        )
        out = root / "dist"
        result = subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (wheel,) = out.glob(f"octopipe_{name}-0.1.0-py3-none-any.whl")
        built[name] = wheel
    return built


def test_wheel_contents(wheels: dict[str, Path]) -> None:
    for name, wheel in wheels.items():
        files = zipfile.ZipFile(wheel).namelist()
        assert "octopipe/__init__.py" not in files, f"{wheel.name} would shadow the namespace"
        assert all(f.startswith(("octopipe/", f"octopipe_{name}-0.1.0.dist-info/")) for f in files), files
        if name == "protos":
            for area in ("plan", "profile", "estimate", "node", "coordinator"):
                for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi", ".proto"):
                    assert f"octopipe/{area}/v1/{area}{suffix}" in files
                assert f"octopipe/{area}/py.typed" in files
            assert not any("build_backend" in f for f in files)
        else:
            assert f"octopipe/{name}/py.typed" in files
            assert f"octopipe/{name}/__init__.py" in files


CHECK = r"""
import importlib, importlib.metadata, sys
targets = sys.argv[2:]
sys.path[:0] = targets
if sys.argv[1] == "torch-free":
    sys.modules["torch"] = None  # any import of torch now fails
    modules = ["octopipe.plan.v1.plan_pb2", "octopipe.profile.v1.profile_pb2", "octopipe.estimate.v1.estimate_pb2",
               "octopipe.node.v1.node_pb2_grpc", "octopipe.coordinator.v1.coordinator_pb2_grpc",
               "octopipe.ir", "octopipe.simulate", "octopipe.tune"]
else:
    modules = ["octopipe.examples", "octopipe.capture", "octopipe.transform", "octopipe.execute"]
for name in modules:
    module = importlib.import_module(name)
    print(name.rsplit(".", 2)[0] if name.endswith("_pb2") or name.endswith("_grpc") else name, module.__file__)
dists = ("protos", "ir", "examples", "capture", "transform", "simulate", "tune", "execute")
versions = {d: importlib.metadata.version("octopipe-" + d) for d in dists}
assert set(versions.values()) == {"0.1.0"}, versions
if sys.argv[1] != "torch-free":
    from octopipe.execute.cli import main
    assert main(["plan", "show", "--example", "1f1b", "--ranks", "3"]) == 0
"""


def test_separate_directories_form_one_namespace(wheels: dict[str, Path], tmp_path: Path) -> None:
    targets = {}
    for name, wheel in wheels.items():
        target = tmp_path / f"site-{name}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--target",
                str(target),
                str(wheel),
            ],
            check=True,
            capture_output=True,
        )
        targets[name] = target
    # -S: no site processing, so the editable install's .pth files are not read;
    # third-party code (torch, protobuf, grpc, structlog, rich) comes from the plain site-packages folder.
    site_packages = sysconfig.get_paths()["purelib"]
    code = f"import sys; sys.path.append({site_packages!r})\n" + CHECK
    origins: dict[str, str] = {}
    for mode in ("torch-free", "with-torch"):
        result = subprocess.run(
            [sys.executable, "-S", "-c", code, mode, *map(str, targets.values())],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        for line in result.stdout.splitlines():
            if line.startswith("octopipe."):
                name, path = line.split(" ", 1)
                origins[name] = path
    for name in ("ir", "examples", "capture", "transform", "simulate", "tune", "execute"):
        assert origins[f"octopipe.{name}"].startswith(str(targets[name])), origins
    for area in ("plan", "profile", "estimate", "node", "coordinator"):
        assert origins[f"octopipe.{area}"].startswith(str(targets["protos"])), origins
    assert "0F0" in result.stdout  # the CLI ran from the separately installed wheels
