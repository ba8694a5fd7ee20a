"""tests/gpu/: every test here needs a CUDA GPU. They are collected in every run (never silently ignored)
and skipped, with the reason, where torch sees none; ``bench/gpu_check.py`` runs them on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from octopipe.transform import visible_gpus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    gpus = visible_gpus()
    reason = f"needs a CUDA GPU; torch {torch.__version__} sees none (torch.cuda.is_available() is false)"
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)
            if not gpus:
                item.add_marker(pytest.mark.skip(reason=reason))
