"""--exit-interval and --exit-duration-in-mins (Megatron's meaning): every rank exits 0 after the
iteration that triggers it, with a checkpoint of that iteration when --save is set. One process,
no launcher (world size 1); --manual-gc rides along."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._launch_util import REPO, TINY_GPT, launch


def run(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT,
                           "--train-iters", "8", "--metrics-file", str(metrics), *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    iterations = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()
                  if "lm_loss" in line] if metrics.exists() else []
    return proc, iterations


@pytest.mark.timeout(120)
def test_exit_interval_saves_and_exits_after_that_iteration(tmp_path):
    proc, iterations = run(tmp_path, "--exit-interval", "3", "--save", str(tmp_path / "ck"),
                           "--save-interval", "100", "--manual-gc", "--manual-gc-interval", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert iterations == [1, 2, 3] and "exiting after iteration 3: --exit-interval 3" in proc.stdout
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.timeout(120)
def test_exit_duration_exits_once_the_time_is_up(tmp_path):
    proc, iterations = run(tmp_path, "--exit-duration-in-mins", "0.00001")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert iterations == [1] and "--exit-duration-in-mins 1e-05" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_job_that_stops_early_releases_its_waiting_spares(tmp_path):
    """After a failure the broken replica's survivor waits as a spare; when the live ranks stop at
    --exit-interval the job is complete: the spare exits 0, and so does the launcher."""
    run = launch(4, [*TINY_GPT, "--tensor-model-parallel-size", "2", "--train-iters", "8",
                     "--exit-interval", "4", "--recover-balance", "even",
                     "--inject-fault", "kill:rank=2,iter=2,phase=backward"],
                 tmp_path / "metrics.jsonl", launcher_args=[])
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["iteration"] for r in run.records if "lm_loss" in r] == [1, 2, 3, 4]
    assert "rank 3: waiting as a spare" in run.stdout + run.stderr
    assert "rank 3 (pid" not in run.stderr  # the supervisor names no failed rank but the victim
