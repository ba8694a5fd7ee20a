"""Build backend for octopipe-protos: generates Python code from the .proto files.

Generated code (messages, gRPC stubs, type stubs) is never committed. It is made
here, by ``generate()``, which both the PEP 517 hooks below (wheel and sdist
builds, Pants' ``package``) and ``scripts/setup.sh`` (an in-place build for
development) call. The hooks then hand over to setuptools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "generate",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_wheel",
]

ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed next to this interpreter, else on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / name,
        Path(sys.executable).parent / name,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} not found: install mypy-protobuf into the build environment "
            "(it is listed in protos/pyproject.toml's build-system.requires)"
        )
    return found


def clean(root: Path = ROOT) -> None:
    """Remove every generated file under ``root``."""
    for path in (root / "octopipe").rglob("*"):
        if path.is_file() and (path.name.endswith(GENERATED_SUFFIXES) or path.name == "py.typed"):
            path.unlink()


def generate(root: Path = ROOT) -> list[Path]:
    """Generate messages, gRPC stubs and type stubs next to each .proto under ``root``."""
    import grpc_tools  # noqa: PLC0415  (a build requirement, not a runtime one)

    clean(root)
    protos = sorted(p.relative_to(root) for p in (root / "octopipe").rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {root / 'octopipe'}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={root}",
        f"--grpc_python_out={root}",
        f"--mypy_out={root}",
        f"--mypy_grpc_out={root}",
        *[str(p) for p in protos],
    ]
    subprocess.run(cmd, check=True, cwd=root)
    # PEP 561 markers: every area and version folder is a typed (namespace) package.
    for proto in protos:
        for folder in (root / proto.parent, root / proto.parent.parent):
            (folder / "py.typed").touch()
    return sorted(p for p in (root / "octopipe").rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def _generated_here() -> None:
    generate(Path(os.getcwd()))


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    return list(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    return list(_setuptools.get_requires_for_build_sdist(config_settings))


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    return list(_setuptools.get_requires_for_build_editable(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    return str(_setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings))


def build_wheel(wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None) -> str:
    _generated_here()
    return str(_setuptools.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    # The sdist ships the .proto files and this backend; generation runs on install.
    return str(_setuptools.build_sdist(sdist_directory, config_settings))


def build_editable(wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None) -> str:
    _generated_here()
    return str(_setuptools.build_editable(wheel_directory, config_settings, metadata_directory))
