"""Markers (declared in pyproject.toml): `gpu` tests need CUDA (scripts/gpu/check.sh runs them on a GPU machine); elsewhere
they are skipped with that reason."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu/check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
