"""The docs say what the code does: every `octopipe` command in a shell block parses, every Python import resolves."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from octopipe.execute.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "packages" / "execute" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(path.read_text()) if lang == language]


def _commands(path: Path) -> list[list[str]]:
    commands = []
    for body in _blocks(path, "sh"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in (".venv/bin/octopipe", "octopipe"):
                commands.append(words[1:])
    return commands


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_octopipe_command_in_the_docs_parses(path: Path) -> None:
    parser = build_parser()
    for argv in _commands(path):
        parser.parse_args(argv)  # raises UsageError (exit 2) on an unknown command or flag


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_import_in_the_docs_resolves(path: Path) -> None:
    for body in _blocks(path, "python"):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("octopipe"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{path.name}: {node.module} has no {alias.name}"


def test_the_docs_have_commands_to_check() -> None:
    if not (ROOT / "docs" / "multinode.md").exists():
        pytest.skip("the docs are not in this sandbox")
    assert len(_commands(ROOT / "docs" / "multinode.md")) >= 6
    assert any(argv[:1] == ["demo"] or argv[:1] == ["run"] for argv in _commands(ROOT / "README.md"))
