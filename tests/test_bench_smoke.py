"""Smoke test of the schedule-overhead benchmark: it runs end to end and prints its ratio line.

Timings are never asserted (a shared 2-core machine); what is checked is that the benchmark measured
what it claims: both arms trained the same model on the same batch (equal first-iteration loss with
dropout off), and a user error is one message with exit code 2.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "schedule_overhead.py"


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout}s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing it started survives
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_benchmark_prints_a_ratio_from_identical_arms():
    run = run_script(["--iters", "2", "--warmup", "1", "--dropout", "0"], timeout=280)
    assert run.returncode == 0, run.stderr[-2000:]
    ratio = re.search(r"^ratio recover/plain: (\d+\.\d+)", run.stdout, re.MULTILINE)
    assert ratio and float(ratio.group(1)) > 0, run.stdout
    losses = re.search(r"first-iteration loss: recover (\S+) plain (\S+)", run.stdout)
    assert losses, run.stdout
    recover, plain = float(losses.group(1)), float(losses.group(2))
    assert abs(recover - plain) <= 1e-5 * abs(plain), (recover, plain)


@pytest.mark.timeout(60)
def test_bad_iteration_count_is_a_user_error():
    run = run_script(["--iters", "0"], timeout=50)
    assert run.returncode == 2
    assert "--iters" in run.stderr and run.stdout == ""
