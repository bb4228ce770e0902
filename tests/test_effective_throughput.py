"""Effective-throughput benchmark: the accounting of committed vs processed tokens (unit tests on
synthetic attempts) and a short real run of all three strategies with one SIGKILL (CI size)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from etp_accounting import (Attempt, Record, TrajectoryError, attempts_from_json,  # noqa: E402
                            check_trajectory, committed_records, expected_id_sum, processed_tokens)
from etp_schedule import FailureSchedule  # noqa: E402

M = 8


def rec(i: int, microbatches: int = M, t: float = 0.0) -> Record:
    return Record(iteration=i, tokens=32 * microbatches, microbatches=microbatches,
                  id_sum=expected_id_sum(i, M) if microbatches == M else 0, lm_loss=1.0, seen_at=t)


def attempt(resumed_from: int, last: int) -> Attempt:
    return Attempt(started_at=0.0, resumed_from=resumed_from,
                   records=[rec(i) for i in range(resumed_from + 1, last + 1)])


def test_work_after_the_checkpoint_is_processed_but_not_committed():
    attempts = [attempt(0, 7), attempt(5, 9)]  # killed after 7, relaunched from checkpoint 5
    committed = check_trajectory(attempts, M, full_batches=True)
    assert [r.iteration for r in committed] == list(range(1, 10))
    assert committed[5] is attempts[1].records[0]  # iteration 6 comes from the relaunch
    assert processed_tokens(attempts) == 32 * M * (7 + 4)
    assert sum(r.tokens for r in committed) == 32 * M * 9


def test_resuming_past_what_was_reached_is_a_broken_trajectory():
    with pytest.raises(TrajectoryError, match="only reached 7"):
        check_trajectory([attempt(0, 7), attempt(8, 10)], M, full_batches=True)


def test_a_gap_inside_an_attempt_is_a_broken_trajectory():
    broken = attempt(0, 5)
    del broken.records[2]
    with pytest.raises(TrajectoryError):
        check_trajectory([broken], M, full_batches=True)


def test_shrunk_batches_fail_full_batch_check_but_count_for_drop():
    a = Attempt(started_at=0.0, resumed_from=0, records=[rec(1), rec(2, microbatches=6)])
    with pytest.raises(TrajectoryError, match="exactly its 8"):
        check_trajectory([a], M, full_batches=True)
    assert [r.microbatches for r in check_trajectory([a], M, full_batches=False)] == [8, 6]


def test_schedule_is_seeded_and_bounded():
    a = FailureSchedule.seeded(3, interval=10, budget=60)
    assert a == FailureSchedule.seeded(3, interval=10, budget=60)
    assert a != FailureSchedule.seeded(4, interval=10, budget=60)
    assert all(0 < t < 60 for t in a.times) and list(a.times) == sorted(a.times)
    assert len(FailureSchedule.seeded(3, interval=10, budget=60, max_failures=2).times) == 2
    assert a.victim(0, [2, 5, 7]) in (2, 5, 7)


def kill_leftover_launches(out: Path) -> None:
    """Each launch runs in its own session (pgid = launcher pid): kill any the benchmark left."""
    for pid_file in out.glob("*/launcher.*.pid"):
        pid = int(pid_file.read_text())
        try:
            if b"recover_patches.launch" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_short_benchmark_accounts_consistently(tmp_path):
    out = tmp_path / "etp"
    cmd = [sys.executable, str(REPO / "scripts/bench/effective_throughput.py"), "--budget", "25",
           "--failure-interval", "10", "--max-failures", "1", "--save-interval", "3",
           "--no-reference", "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=360)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the benchmark itself
        except ProcessLookupError:
            pass
        proc.wait()
        kill_leftover_launches(out)
    assert proc.returncode == 0, stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (out / "committed_tokens.png").stat().st_size > 0
    assert "vs C/R" in stdout and "checkpoint_restart" in stdout
    for name in ("recover", "drop", "checkpoint_restart"):
        arm = results["arms"][name]
        attempts, summary = attempts_from_json(arm["attempts"]), arm["summary"]
        assert len(arm["kills"]) == 1, (name, stdout[-2000:])
        committed = check_trajectory(attempts, M, full_batches=name != "drop")
        assert summary["committed_tokens"] == sum(r.tokens for r in committed)
        # C/R may legitimately commit nothing in 25 s (killed before its first checkpoint)
        assert name == "checkpoint_restart" or summary["committed_tokens"] > 0
        assert summary["committed_tokens"] <= summary["processed_tokens"] == processed_tokens(attempts)
    cr = attempts_from_json(results["arms"]["checkpoint_restart"]["attempts"])
    assert len(cr) >= 2 and cr[1].resumed_from % 3 == 0  # relaunched from a checkpoint
    assert len(committed_records(cr)) <= sum(len(a.records) for a in cr)
    recover = attempts_from_json(results["arms"]["recover"]["attempts"])
    assert len(recover) == 1 and any(r.recovery_seconds for r in recover[0].records)  # survived in-job


# -- the simulator calibrated from the measured costs ---------------------------------------------
from scripts.sim import SCENARIOS, SimConfigError  # noqa: E402
from scripts.sim.calibration import MeasuredCosts, calibrate  # noqa: E402

MEASURED = {"iteration_seconds": 0.2, "recovery_seconds": 0.1, "checkpoint_save_seconds": 0.05,
            "restart_seconds": 10.0}


def test_calibration_keeps_costs_in_iterations_or_in_seconds(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**MEASURED, "source": "test"}))
    costs = MeasuredCosts.from_json(path)
    base = SCENARIOS["paper"]().config  # 6 s iterations: 30x the measured 0.2 s
    scaled = calibrate(base, costs)
    assert (scaled.recovery_seconds, scaled.checkpoint_save_seconds, scaled.restart_seconds) \
        == pytest.approx((3.0, 1.5, 300.0))
    assert scaled.checkpoint_load_seconds == 0.0 and scaled.gpus == base.gpus
    absolute = calibrate(base, costs, "absolute")
    assert (absolute.recovery_seconds, absolute.restart_seconds) == (0.1, 10.0)


@pytest.mark.parametrize("broken", [{"restart_seconds": None}, {"iteration_seconds": 0},
                                    {"recovery_seconds": -1.0}])
def test_calibration_file_with_a_bad_field_is_rejected_by_name(tmp_path, broken):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({**MEASURED, **broken}))
    with pytest.raises(SimConfigError, match=next(iter(broken))):
        MeasuredCosts.from_json(path)


@pytest.mark.timeout(120)
def test_sim_cli_uses_the_measured_costs(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(MEASURED))
    script = str(REPO / "scripts" / "sim" / "run_sim.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, script, "--scenario", "paper", "--no-plot",
                           "--calibration", str(path)], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    assert "costs measured" in done.stdout and "restart+load 300 s" in done.stdout
    assert "check: simulated C/R ETTR" in done.stdout
    bad = subprocess.run([sys.executable, script, "--scenario", "paper", "--no-plot",
                          "--calibration", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=100, env=env)
    assert bad.returncode == 2 and "--calibration" in bad.stderr


def test_a_record_lost_with_the_logging_rank_is_counted_but_not_batch_checked():
    from etp_accounting import unreported_gap
    a = attempt(0, 5)
    later = rec(7)
    a.records += unreported_gap(a.records[-1], 0, later) + [later]  # iteration 6's record is missing
    committed = check_trajectory([a], M, full_batches=True)
    assert [r.iteration for r in committed] == list(range(1, 8))
    assert [r.reported for r in committed].count(False) == 1 and committed[5].tokens == later.tokens
