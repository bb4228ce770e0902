"""The README's first command: the embedded default trains on real text, survives the injected
failure on the failure-free curve, and re-forms the broken replica with a replacement. (How long
it takes is not asserted here -- this machine is shared and noisy; the README states it.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests._launch_util import REPO

pytestmark = pytest.mark.multiprocess  # every test here starts several processes


@pytest.mark.timeout(900)
def test_demo_survives_its_failure_with_a_falling_loss(tmp_path):
    env = {**os.environ, "DEMO_DIR": str(tmp_path / "data"), "DEMO_RUN_DIR": str(tmp_path / "run"),
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-4000:]
    assert "every iteration committed the reference's microbatches: yes" in out, out[-3000:]
    assert "iteration 40: dead ranks [3]" in out, out[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "run" / "with_failure.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(losses) == 100 and losses[-1] < losses[0] - 2.0, losses[::10]
    assert (tmp_path / "run" / "losses.png").stat().st_size > 10_000
    assert "re-formed and joined" in out, out[-3000:]
    assert [len(r["live_replicas"]) for r in records if "lm_loss" in r][-1] == 2
