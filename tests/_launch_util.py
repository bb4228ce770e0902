"""Run the trainer through the launcher in a subprocess, bounded in time, and read its metrics.

The launcher runs in its own session; whatever happens, the whole process group is killed, so no
rank can outlive the test.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--lr", "1e-3", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict]

    def losses(self) -> list[float]:
        return [r["lm_loss"] for r in self.records if "lm_loss" in r]


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(nproc: int, args: list[str], metrics: Path, *, timeout: float = 240,
           env: dict | None = None, launcher_args: list[str] | None = None,
           script: tuple[str, ...] = (str(REPO / "pretrain_gpt_recover.py"),)) -> Run:
    """`script`: the rank script and its leading arguments (a wrapper, then the entry point)."""
    launch_args = ["--nproc-per-node", str(nproc), "--master-port", "0",
                   *(["--no-coordinator"] if launcher_args is None else launcher_args),
                   *script, *args, "--metrics-file", str(metrics)]
    full_env = {**base_env(), **(env or {})}
    if _ZYGOTE.usable(env):
        returncode, out, err = _ZYGOTE.run(launch_args, full_env, timeout)
        return Run(returncode, out, err, read_metrics(metrics))
    cmd = [sys.executable, "-m", "recover_patches.launch", *launch_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    record_session(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # kept: what a hung run printed is what explains it
        native = dump_stacks(proc.pid)
        kill_session(proc.pid)
        out, err = proc.communicate(timeout=30)
        err += f"{native}\ntimed out after {timeout}s"
    finally:
        kill_session(proc.pid)
        proc.wait()
    return Run(proc.returncode, out, err, read_metrics(metrics))


def base_env() -> dict[str, str]:
    # megatron-core writes NVTE_*_ATTN into os.environ when it builds a model for the attention
    # backend (in-process tests do) and asserts they agree in the next model: not inherited
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    return {**inherited, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def dump_stacks(pgid: int, wait: float = 3.0) -> str:
    """Every thread's Python stack of each rank in the launcher's process group, into the rank's
    stderr (faulthandler on SIGUSR2); returned, the native stacks of every process of the group
    (the launcher and its coordinator too) where `py-spy` is on the PATH."""
    ranks, group = [], []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            if int(fields[2]) != pgid:
                continue
            group.append(pid)  # the launcher and its coordinator too: a hang at exit is theirs
            if pid != pgid and b"pretrain_gpt_recover" in (stat.parent / "cmdline").read_bytes():
                ranks.append(pid)  # (not the launcher: the group's leader, no handler)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    native = []
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    for pid in sorted(group):
        if shutil.which("py-spy"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                native.append(subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)],
                                             timeout=30, capture_output=True, text=True).stdout)
    time.sleep(wait if ranks else 0)
    return "".join(native)


def record_session(pid: int) -> None:
    """With RECOVER_LAUNCH_SESSIONS=FILE, each launcher's session id goes there: a harness killed
    at its bound (scripts/gpu/short.sh) leaves its caller the sessions to end, by group."""
    sessions = os.environ.get("RECOVER_LAUNCH_SESSIONS")
    if sessions:
        with open(sessions, "a") as f:
            f.write(f"{pid}\n")


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Zygote:
    """The warm launcher-forking server of `tests/_launch_zygote.py`, started at the first launch
    and ended with the test process. A launch whose extra environment could matter while torch or
    megatron-core import (their own variables) starts a fresh interpreter instead, as does any
    launch with RECOVER_TEST_ZYGOTE=0 in the environment."""
    IMPORT_TIME_ENV = ("TORCH", "NVTE_", "CUDA", "OMP_", "MKL_", "PYTHON", "NCCL",
                       "MALLOC_")  # (glibc reads MALLOC_* when a process starts)

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def usable(self, extra_env: dict | None) -> bool:
        if os.environ.get("RECOVER_TEST_ZYGOTE", "1") == "0" or sys.platform != "linux":
            return False
        return not any(k.startswith(self.IMPORT_TIME_ENV) for k in (extra_env or {}))

    def _server(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests/_launch_zygote.py")], cwd=REPO, env=base_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
            atexit.register(self.close)
        return self.proc

    def run(self, args: list[str], env: dict, timeout: float
            ) -> tuple[int, str, str]:
        # not beside `metrics`: a test may assert that a refused run created nothing there
        scratch = Path(tempfile.mkdtemp(prefix="recover-launch-"))
        files = {k: scratch / k for k in ("out", "err", "status")}
        with self.lock:
            server = self._server()
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps({"args": args, "env": env, "cwd": str(REPO),
                                           **{k: str(v) for k, v in files.items()}}) + "\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
        record_session(pid)
        deadline, timed_out, stacks = time.monotonic() + timeout, False, ""
        while not files["status"].exists():
            if time.monotonic() > deadline:
                if timed_out:  # killed 30 s ago and never reaped: the server is gone
                    break
                timed_out = True
                stacks = dump_stacks(pid)  # kept, with what it printed: they explain a hang
                kill_session(pid)
                deadline = time.monotonic() + 30  # its status once reaped
            time.sleep(0.02)
        kill_session(pid)  # whatever the launcher left behind in its session
        returncode = int(files["status"].read_text()) if files["status"].exists() else -9
        out, err = (files[k].read_text(errors="replace") for k in ("out", "err"))
        shutil.rmtree(scratch, ignore_errors=True)
        return (returncode, out, f"{err}{stacks}\ntimed out after {timeout}s") if timed_out \
            else (returncode, out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # end of requests: the server returns
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                kill_session(self.proc.pid)


_ZYGOTE = _Zygote()


class TimedOutput:
    """A process's output lines with the time each arrived (the test's clock)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._readers = [threading.Thread(target=self._read, args=(stream,), daemon=True)
                         for stream in (proc.stdout, proc.stderr)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line))

    def join(self) -> str:
        for reader in self._readers:
            reader.join(10)
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)


def wait_ended(proc: subprocess.Popen, limit: float) -> float:
    """When `proc` exited (the test's clock); killed with its group past `limit`."""
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return time.monotonic()


def group_alive(pgid: int) -> bool:
    """Whether any process of the launcher's group (its ranks, replacements, coordinator) is
    still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Launched:
    """Launchers run to their end: each one's status, when it ended (the test's clock), whether
    any process of its group outlived it, and its output with arrival times."""
    returncodes: dict[str, int]
    ended: dict[str, float]
    left: dict[str, bool]
    outputs: dict[str, TimedOutput]

    def text(self, name: str) -> str:
        return "".join(line for _, line in self.outputs[name].lines)

    def everything(self) -> str:
        return "".join(self.text(name) for name in self.outputs)


def run_launchers(commands: dict[str, list[str]], limit: float, env: dict | None = None,
                  before: dict[str, Callable[[], object]] | None = None) -> Launched:
    """Start each launcher (`python -m recover_patches.launch` + its arguments) in its own
    session, in order (`before[name]()` first, where given), wait for all (killed past `limit`),
    and kill whatever of their groups is left."""
    procs: dict[str, subprocess.Popen] = {}
    outputs: dict[str, TimedOutput] = {}
    try:
        for name, arguments in commands.items():
            if before and name in before:
                before[name]()
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "recover_patches.launch", *arguments], cwd=REPO,
                env={**base_env(), **(env or {})}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True)
            record_session(procs[name].pid)
            outputs[name] = TimedOutput(procs[name])
        ended = {name: wait_ended(proc, limit) for name, proc in procs.items()}
        left = {name: group_alive(proc.pid) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            kill_session(proc.pid)
            proc.wait()
    for out in outputs.values():
        out.join()
    return Launched({name: proc.returncode for name, proc in procs.items()}, ended, left, outputs)
