"""The launcher with tiny rank scripts (no torch in the children: --preload none)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

# Every rank records its pid and env, then behaves as told by its per-rank line in BEHAVIOUR.
RANK_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    info = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "GROUP_RANK")}
    info.update(pid=os.getpid(), argv=sys.argv, name=__name__,
                preloaded="xml.dom.minidom" in sys.modules)
    with open(os.path.join(out, f"start.{rank}"), "w") as f:
        json.dump(info, f)
    action = json.loads(sys.argv[2]).get(str(rank), "ok")
    if action == "exit3":
        sys.exit(3)
    if action == "raise":
        raise ValueError("boom from the rank script")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if action == "nap":
        time.sleep(1.5)
    if action in ("sleep", "ignore_term"):
        open(os.path.join(out, f"sleeping.{rank}"), "w").close()
        time.sleep(60)
    time.sleep(0.5)  # outlive the failing ranks: their death must not take us down
    open(os.path.join(out, f"done.{rank}"), "w").close()
""")


def start_launcher(tmp_path: Path, nproc: int, behaviour: dict, *extra: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(nproc),
           "--no-coordinator", "--preload", "none", "--master-port", "0", *extra,
           str(script), str(tmp_path), json.dumps(behaviour)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def rank_pids(tmp_path: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in tmp_path.glob("start.*")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 20) -> tuple[int, str]:
    """Wait for the launcher; whatever happens, kill it and every rank it started, by PID."""
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    finally:
        for pid in [proc.pid, *rank_pids(tmp_path)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def wait_for_files(tmp_path: Path, pattern: str, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"timed out waiting for {count} x {pattern}"
        time.sleep(0.02)


@pytest.mark.multiprocess


def test_env_argv_and_preload(tmp_path):
    proc = start_launcher(tmp_path, 3, {}, "--preload", "xml.dom.minidom")
    code, err = finish(proc, tmp_path)
    assert code == 0, err
    infos = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob("start.*")}
    assert sorted(infos) == [0, 1, 2]
    ports = {i["MASTER_PORT"] for i in infos.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0  # --master-port 0 resolved once for all
    for rank, info in infos.items():
        assert info["RANK"] == info["LOCAL_RANK"] == str(rank)
        assert info["WORLD_SIZE"] == info["LOCAL_WORLD_SIZE"] == "3"
        assert info["GROUP_RANK"] == "0" and info["MASTER_ADDR"] == "127.0.0.1"
        assert info["OMP_NUM_THREADS"] == "1"
        assert info["name"] == "__main__"
        assert info["argv"][0].endswith("rank.py") and info["argv"][1] == str(tmp_path)
        assert info["preloaded"] is True
    assert "all 3 rank(s) exited 0" in err
    assert not any(alive(pid) for pid in rank_pids(tmp_path))


def test_a_cold_rank_is_a_fresh_interpreter(tmp_path):
    # The fallback when a preload touched CUDA: the forked child execs python instead of reusing
    # the parent's modules (this test process has xml.dom.minidom; the warm test above inherits it).
    import xml.dom.minidom  # noqa: F401
    from recover_patches.launch import fork_rank
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    pid = fork_rank(str(script), [str(tmp_path), "{}"], env, warm=False)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(status) == 0
    info = json.loads((tmp_path / "start.0").read_text())
    assert info["pid"] == pid and info["RANK"] == "0" and info["name"] == "__main__"
    assert info["preloaded"] is False and info["argv"][1:] == [str(tmp_path), "{}"]


@pytest.mark.multiprocess


def test_multi_node_rank_numbering(tmp_path):
    # The port is only passed on here (nothing listens in these ranks); the last flag wins.
    proc = start_launcher(tmp_path, 2, {}, "--nnodes", "3", "--node-rank", "2", "--master-port", "1234")
    code, err = finish(proc, tmp_path)
    assert code == 0, err
    infos = [json.loads(p.read_text()) for p in tmp_path.glob("start.*")]
    assert sorted((i["RANK"], i["LOCAL_RANK"]) for i in infos) == [("4", "0"), ("5", "1")]
    assert {i["WORLD_SIZE"] for i in infos} == {"6"}


@pytest.mark.multiprocess


def test_failing_ranks_do_not_kill_the_others(tmp_path):
    proc = start_launcher(tmp_path, 4, {"1": "exit3", "2": "raise", "3": "sigkill"})
    code, err = finish(proc, tmp_path)
    assert code == 1
    assert (tmp_path / "done.0").exists(), "rank 0 was taken down by the failure of others"
    assert "rank 1 (pid" in err and "failed: exit code 3" in err
    assert "failed: exit code 1" in err and "ValueError: boom from the rank script" in err
    assert "rank 3 (pid" in err and "killed by signal SIGKILL" in err
    assert "3 of 4 rank(s) failed" in err
    assert "rank 0 (pid" not in err
    assert not any(alive(pid) for pid in rank_pids(tmp_path))


@pytest.mark.multiprocess


def test_launcher_idles_while_ranks_run(tmp_path):
    """An exited rank must not leave the launcher spinning (it would starve the survivors)."""
    proc = start_launcher(tmp_path, 2, {"0": "exit3", "1": "nap"})
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        finish(proc, tmp_path, timeout=5)
    assert os.waitstatus_to_exitcode(status) == 3  # the rank stopped the job for a restart
    assert (tmp_path / "done.1").exists()
    assert usage.ru_utime + usage.ru_stime < 0.8, usage  # launcher + tiny ranks, over ~2 s


@pytest.mark.multiprocess


def test_sigterm_is_forwarded_then_sigkill_after_grace(tmp_path):
    proc = start_launcher(tmp_path, 2, {"0": "sleep", "1": "ignore_term"}, "--term-grace", "0.5")
    try:
        wait_for_files(tmp_path, "sleeping.*", 2)
    except AssertionError:
        finish(proc, tmp_path, timeout=1)
        raise
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, tmp_path)
    assert code == 128 + signal.SIGTERM
    assert "rank 0" in err and "killed by signal SIGTERM" in err
    assert "rank 1" in err and "killed by signal SIGKILL" in err
    assert not any(alive(pid) for pid in rank_pids(tmp_path))


@pytest.mark.parametrize("flags, needle", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    (["--nnodes", "2", "--node-rank", "1", "--master-port", "0"], "--master-port"),
    (["--heartbeat-timeout", "1"], "derive from the training script's --recover-timeout"),
    (["--standby"], "--standby joins a running job"),  # --no-coordinator, no port, no token
])
@pytest.mark.multiprocess
def test_usage_errors_exit_2_and_start_nothing(tmp_path, flags, needle):
    proc = start_launcher(tmp_path, 2, {}, *flags)
    code, err = finish(proc, tmp_path)
    assert code == 2 and needle in err
    assert not list(tmp_path.glob("start.*"))


def test_exit_rule_with_declared_completion(caplog):
    from recover_patches.supervisor import Rank, summarize

    caplog.set_level(logging.INFO, logger="recover_patches.supervisor")

    def ranks(*codes):  # raw wait statuses: exit code c, or killed by signal -c
        return [Rank(rank=i, pid=100 + i, status=(c << 8) if c >= 0 else -c)
                for i, c in enumerate(codes)]
    assert summarize(ranks(0, 0), None) == 0
    assert summarize(ranks(0, -9), None) == 1                     # no coordinator verdict
    assert summarize(ranks(0, -9, 1), (2, frozenset({1, 2}))) == 0  # the job survived both
    assert summarize(ranks(0, -9, 1), (1, frozenset({1}))) == 1     # rank 2 failed outside it
    assert summarize(ranks(2, 2), None) == 2                      # the ranks' user error
    assert summarize(ranks(0, 3, 2), None) == 3                   # stopped for a restart
    assert summarize(ranks(2, 1), None) == 1                      # anything else: a failure
    # the coordinator stopped the job (no replica holds the state): restart, killed ranks or not
    assert summarize(ranks(-9, 3, 0), None, "no replica") == 3
    assert summarize(ranks(-9, 1), None, "no replica") == 1       # unless a rank crashed
    assert summarize(ranks(-9, 3), (2, frozenset({0})), "no replica") == 1  # completion wins
    err = "\n".join(r.getMessage() for r in caplog.records)
    assert "rank 1 (pid 101) failed: killed by signal SIGKILL" in err
    assert "rank 2 (pid 102) failed: exit code 1" in err
    assert "but rank(s) [2] failed outside it" in err


def test_the_preload_keeps_megatron_cores_fallback_notes_out_of_the_launchers_output():
    """Importing megatron-core prints four notes that transformer-engine and Apex are missing;
    the launcher preloads it, so every launch printed them before any rank (the demo's two runs,
    twice). Control: megatron-core's source still raises those notes."""
    import megatron.core.optimizer as optimizer_package
    source = Path(optimizer_package.__file__).read_text()
    assert "Transformer Engine and Apex are not installed" in source  # the notes exist
    env = {**os.environ, "PYTHONWARNINGS": ""}
    preloaded = subprocess.run(
        [sys.executable, "-c", "from recover_patches.launch import preload; "
         "assert preload('megatron.core')"], capture_output=True, text=True, timeout=120, env=env)
    assert preloaded.returncode == 0, preloaded.stderr
    assert "Transformer Engine" not in preloaded.stderr and "Apex" not in preloaded.stderr
