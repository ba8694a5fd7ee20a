"""Shared by every test: where compiled code is cached.

Inductor's on-disk cache is shared by the whole run (this process and every rank it starts), as in a user's
runs, so a graph compiles once. octopipe's compile index (``transform.compile_cache``) is the test's own: it starts
cold, so ``--compile auto`` (the CLI's default) runs every graph as captured unless the test fills the index
itself, whatever other tests compiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from octopipe.transform.compile_cache import use_compile_cache_dirs

use_compile_cache_dirs()


@pytest.fixture(autouse=True)
def _own_compile_index(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("compile-index")
    monkeypatch.setenv("OCTOPIPE_COMPILE_INDEX", str(folder))
    yield folder
