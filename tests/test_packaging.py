"""The installed project (scripts/env.sh runs `pip install -e .[test,plot]` into a fresh venv in CI):
its console scripts start from outside the repository and answer --help."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ["recover-launch", "recover-coordinator", "recover-preprocess"]


def test_pyproject_declares_the_entry_points_and_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(project["scripts"]) == sorted(ENTRY_POINTS)
    assert {"gpu", "wandb", "plot"} <= set(project["optional-dependencies"])
    assert not (REPO / "megatron" / "__init__.py").exists(), "megatron must stay a namespace package"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_runs_from_outside_the_repository(name, tmp_path):
    script = Path(sys.executable).parent / name
    assert script.exists(), f"{script} missing: install the project with pip install -e ."
    done = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name} "), done.stdout[:200]
