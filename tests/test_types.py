"""The runtime type-checks clean: mypy over recover_patches/, megatron/training/ and the entry
point, configured in pyproject.toml ([tool.mypy]). Protocols (ReplicaStep, Optimizer,
ReplicaState, ...) are only as true as this check makes them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests._launch_util import REPO


def mypy(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=280)


@pytest.mark.timeout(300)
def test_the_runtime_type_checks_clean():
    result = mypy()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout
