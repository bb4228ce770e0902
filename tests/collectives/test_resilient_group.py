"""ResilientProcessGroup over real gloo groups, in ranks started by our launcher with a coordinator.

See rank_scenarios.py for what each rank does. Two jobs: five SIGKILLs (one per operation kind)
in one 7-rank job, and one SIGSTOP hang in a 3-rank job.
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

SCRIPT = Path(__file__).with_name("rank_scenarios.py")
OP_TIMEOUT = 2.0  # --recover-timeout of the ranks: the heartbeat and stall timeouts derive from it


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_job(tmp_path: Path, nproc: int, mode: str, op_timeout: float
            ) -> tuple[int, str, dict[int, dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(nproc),
           "--preload", "torch", "--master-port", "0", str(SCRIPT), str(tmp_path), mode,
           str(op_timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err = ""
    try:
        _, err = proc.communicate(timeout=45)
    finally:  # whatever happened: kill the launcher, its ranks and its coordinator, by PID
        pids = [proc.pid] + [int(p.read_text()) for p in tmp_path.glob("pid.*")]
        pids += [int(m) for m in re.findall(r"coordinator pid (\d+)", err)]
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    leftovers = [pid for pid in pids if alive(pid)]
    assert not leftovers, f"processes left running: {leftovers}"
    assert re.search(r"coordinator pid \d+", err), err
    results = {int(p.name.split(".")[1]): json.loads(p.read_text())
               for p in tmp_path.glob("result.*.json")}
    return proc.returncode, err, results


def check_survivors(results: dict[int, dict], err: str, expected: list[tuple[str, int]],
                    max_latency: float) -> None:
    assert sorted(results) == [0, 1], f"survivor results missing:\n{err}"
    for rank, result in results.items():
        got = [(r["op"], r["victim"]) for r in result["records"]]
        assert got == expected, (rank, got)
        for epoch, record in enumerate(result["records"]):
            failure = record["failure"]
            assert failure is not None, f"rank {rank}: {record['op']} did not fail"
            assert failure["suspects"] == [record["victim"]] and failure["confirmed"], failure
            assert failure["epoch"] == epoch
            assert failure["latency"] < max_latency, failure
            assert record["rebuilt_members"] == [0, 1] and record["rebuilt_epoch"] == epoch + 1
            assert record["rebuilt_sum"] == 3.0  # 1 + 2 over the rebuilt group of survivors
        assert result["threads"] == ["MainThread"], result["threads"]


@pytest.mark.timeout(60)
def test_sigkill_during_each_operation(tmp_path):
    code, err, results = run_job(tmp_path, 7, "kills", OP_TIMEOUT)
    ops = ["allreduce", "allgather", "broadcast", "send", "recv"]
    check_survivors(results, err, [(op, k + 2) for k, op in enumerate(ops)], max_latency=1.0)
    for victim in range(2, 7):
        assert re.search(rf"rank {victim} \(pid \d+\) failed: killed by signal SIGKILL", err), err
    # The survivors declared completion after the five deaths: the launch counts as a success.
    assert code == 0, err
    assert "job declared completion at epoch 5" in err


@pytest.mark.timeout(60)
def test_sigstop_hang_is_detected_fenced_and_survived(tmp_path):
    # The survivors' allreduce times out after OP_TIMEOUT; the victim, stopped (no heartbeat, no
    # progress), is declared dead OP_TIMEOUT + 0.5 s after its last beat or mark, and the
    # survivors' PeerFailure names it (confirmed). The bound here is loose (timeout + 1.5 s, a
    # loaded machine); scripts/bench/failure_detection.py measures the latency.
    code, err, results = run_job(tmp_path, 3, "hang", OP_TIMEOUT)
    check_survivors(results, err, [("allreduce", 2)], max_latency=OP_TIMEOUT + 1.5)
    assert "rank 2 declared dead by the coordinator: SIGKILL" in err  # the launcher fenced it
    assert code == 0, err


def test_a_backend_error_reads_as_one_short_cause_and_the_raw_text_goes_to_the_debug_log(caplog):
    """What the demo printed on a recovery line: gloo's source location, its advice and its
    farewell. ReCoVer's line keeps what happened; the raw text stays in the debug log. Control:
    a message with none of gloo's decoration is left as it is, and logs nothing."""
    import logging

    from recover_patches.collectives.errors import short_cause
    raw = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
           "closed by peer [127.0.0.1]:54485. This is typically caused by a remote worker "
           "crashing. Check the logs of the remote worker before reporting an error. GLHF! \U0001F3D6")
    with caplog.at_level(logging.DEBUG, logger="recover_patches.collectives.errors"):
        assert short_cause(RuntimeError(raw)) == "Connection closed by peer [127.0.0.1]:54485"
        assert raw in caplog.text
        caplog.clear()
        assert short_cause("the group's epoch is over") == "the group's epoch is over"
        assert caplog.text == ""
    assert short_cause("x" * 500).endswith("...") and len(short_cause("x" * 500)) == 160
