"""Smoke test of the schedule-overhead benchmark: it runs end to end and prints its ratio line.

Timings are never asserted (a shared 2-core machine); what is checked is that the benchmark measured
what it claims: both arms trained the same model on the same batch (equal first-iteration loss with
dropout off), and a user error is one message with exit code 2.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "schedule_overhead.py"


def run_script(args: list[str], timeout: float, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
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


BUBBLE = SCRIPT.parent / "interleaved_bubble.py"


@pytest.mark.timeout(300)
def test_bubble_benchmark_compares_the_same_training_in_both_schedules(tmp_path):
    run = run_script(["--pp", "2", "--microbatches", "4", "--device-ms", "5", "--iters", "1",
                      "--warmup", "1", "--out-dir", str(tmp_path)], timeout=280, script=BUBBLE)
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    assert re.search(r"^ratio VP2/VP1: ms per iteration \d+\.\d+", run.stdout, re.MULTILINE)
    losses = re.search(r"first measured loss: VP1 (\S+) VP2 (\S+)", run.stdout)
    assert losses and abs(float(losses.group(1)) - float(losses.group(2))) <= 1e-5, run.stdout
    assert (tmp_path / "interleaved_bubble.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_bubble_benchmark_refuses_a_pipeline_it_cannot_split():
    run = run_script(["--pp", "3"], timeout=50, script=BUBBLE)
    assert run.returncode == 2 and "--pp" in run.stderr and run.stdout == ""


@pytest.mark.timeout(60)
def test_recovery_breakdown_refuses_a_layout_without_a_second_replica():
    run = run_script(["--layout", "2,2,1"], timeout=50,
                     script=SCRIPT.parent / "recovery_breakdown.py")
    assert run.returncode == 2 and "--layout" in run.stderr and run.stdout == ""


COORDINATOR_LOAD = SCRIPT.parent / "coordinator_load.py"


@pytest.mark.timeout(120)
def test_coordinator_load_benchmark_names_the_storm_and_the_stuck_rank(tmp_path):
    """Four nodes, T = 1 s: in both arms the coordinator names every rank of the storm's node
    and the stuck rank, each within its window (the verdict's budget is T + 1 s)."""
    run = run_script(["--nodes", "4", "--warmup", "0.5", "--recover-timeout", "1",
                      "--out", str(tmp_path)], timeout=110, script=COORDINATOR_LOAD)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "coordinator_load.json").read_text())
    assert [(r["nodes"], r["arm"]) for r in rows] == [(4, "node"), (4, "rank")]
    for r in rows:
        assert r["named"] == r["storm_ranks"] == 8, r  # the storm's one node, all 8 ranks
        assert 1.5 - 0.2 <= r["death_to_verdict_max_s"] <= 2.0 + 1.0, r  # stall, then T + 1 s
        assert r["stuck_verdict_after_progress_s"] >= 1.5 - 0.2, r
    assert (tmp_path / "coordinator_load.png").stat().st_size > 0
    assert re.search(r"^\s+4 node\s+\d+", run.stdout, re.MULTILINE), run.stdout


@pytest.mark.timeout(60)
def test_coordinator_load_benchmark_refuses_a_node_count_below_two():
    run = run_script(["--nodes", "1"], timeout=50, script=COORDINATOR_LOAD)
    assert run.returncode == 2 and "--nodes" in run.stderr and run.stdout == ""


CP_ATTENTION = SCRIPT.parent / "cp_attention.py"


@pytest.mark.timeout(120)
def test_cp_attention_benchmark_measures_every_size_and_plots(tmp_path):
    plot = tmp_path / "cp.png"
    run = run_script(["--seq", "64", "--heads", "2", "--head-dim", "8", "--cp", "1", "2",
                      "--repeats", "1", "--plot", str(plot)], timeout=110, script=CP_ATTENTION)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"CP (\d) (\w+) *: per rank wall +([\d.]+) ms +cpu +([\d.]+) ms +peak "
                      r"\+ *([\d.]+) MiB +ratio to CP 1: cpu ([\d.]+)", run.stdout)
    assert [r[:2] for r in rows] == [("1", "full"), ("2", "a2a"), ("2", "allgather"),
                                     ("2", "p2p")], run.stdout
    assert all(float(r[3]) > 0 for r in rows) and rows[0][5] == "1.00", rows
    assert plot.stat().st_size > 0
    refused = run_script(["--seq", "64", "--cp", "1", "3"], timeout=50, script=CP_ATTENTION)
    assert refused.returncode == 2 and "--seq must be a multiple" in refused.stderr


EXACT_REDUCTION = SCRIPT.parent / "exact_reduction.py"


@pytest.mark.timeout(120)
def test_exact_reduction_benchmark_times_both_modes_and_counts_the_wire(tmp_path):
    plot = tmp_path / "exact.png"
    run = run_script(["--hidden", "64", "--seq", "32", "--iters", "4", "--rounds", "1",
                      "--plot", str(plot)], timeout=110, script=EXACT_REDUCTION)
    assert run.returncode == 0, run.stderr[-2000:]
    phases = re.findall(r"(\w+) +default +([\d.]+) ms +exact +([\d.]+) ms +ratio ([\d.]+)",
                        run.stdout)
    assert [p[0] for p in phases] == ["iteration", "execute", "reduce", "step"], run.stdout
    assert all(float(p[1]) > 0 and float(p[2]) > 0 for p in phases), phases
    wire = re.search(r"default ([\d.]+) MiB, exact ([\d.]+) MiB, ratio 2.00", run.stdout)
    assert wire and float(wire.group(2)) == pytest.approx(2 * float(wire.group(1)), rel=1e-2)
    assert plot.stat().st_size > 0
