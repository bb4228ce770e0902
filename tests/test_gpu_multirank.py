"""NCCL: several NCCL ranks on one GPU (scripts/gpu/multirank.py --quick): at (2,1,2) the
failure-free losses equal one process's, and a rank of replica 1 SIGKILLed in backward is
survived with the same losses while replica 0 keeps its tensor-parallel communicator.
Skipped without CUDA (see conftest); the full harness is scripts/gpu/multirank.sh."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._launch_util import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


@pytest.mark.timeout(1200)
def test_shared_gpu_ranks_train_like_one_process_and_survive_a_kill(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/multirank.py"), "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=1150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert not any(r["problems"] for r in runs.values()), runs
    (recovery,) = runs["2x1x2-kill"]["recoveries"]
    assert "tp.replica0.stage0" in recovery["groups_kept"], recovery
