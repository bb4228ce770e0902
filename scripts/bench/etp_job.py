"""Run one arm of the effective-throughput benchmark: launch the job, SIGKILL ranks on the shared
schedule, relaunch from the latest checkpoint whenever the whole job stopped, until the budget ends.

Every launch runs in its own session and is SIGKILLed as a process group when the budget ends or
anything goes wrong, so no rank outlives the arm.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from etp_accounting import Attempt, Kill, record_from_metrics, unreported_gap
from etp_schedule import FailureSchedule

REPO = Path(__file__).resolve().parents[2]
RANK_ENTRY = Path(__file__).resolve().parent / "rank_entry.py"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # written by megatron/training/checkpointing/__init__.py
POLL_SECONDS = 0.05


@dataclass
class ArmSpec:
    name: str
    trainer_args: list[str]     # strategy flags, e.g. ["--recover", "off"]
    save_interval: int | None   # iterations between checkpoints; None = no checkpoints
    inject_failures: bool = True
    stop_after_records: int | None = None  # calibration: stop once this many iterations ran
    launcher_args: list[str] = field(default_factory=list)  # e.g. ["--max-replacements", "8"]


@dataclass
class ArmRun:
    spec: ArmSpec
    attempts: list[Attempt] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    log_lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds, stdout line)


class StdoutReader(threading.Thread):
    """Timestamps every stdout line of a launch (used to time checkpoint saves)."""

    def __init__(self, stream, t0: float, sink: list[tuple[float, str]], log_file) -> None:
        super().__init__(daemon=True)
        self.stream, self.t0, self.sink, self.log_file = stream, t0, sink, log_file

    def run(self) -> None:
        for line in self.stream:
            self.sink.append((time.monotonic() - self.t0, line.rstrip("\n")))
            self.log_file.write(line)
        self.log_file.flush()


def read_latest(save_dir: Path | None) -> int:
    if save_dir is None or not (save_dir / LATEST_FILE).exists():
        return 0
    return int((save_dir / LATEST_FILE).read_text().strip())


def live_rank_pids(pid_dir: Path) -> dict[int, int]:
    """rank -> pid for ranks of this launch that are still running (not exited, not zombies)."""
    live = {}
    for path in pid_dir.glob("rank*.pid"):
        pid = int(path.read_text())
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in ("Z", "X"):
            live[int(path.stem.removeprefix("rank"))] = pid
    return live


class ArmRunner:
    def __init__(self, spec: ArmSpec, job_args: list[str], nproc: int, workdir: Path,
                 schedule: FailureSchedule, budget: float) -> None:
        self.spec, self.job_args, self.nproc = spec, job_args, nproc
        self.workdir, self.schedule, self.budget = workdir / spec.name, schedule, budget
        self.save_dir = self.workdir / "checkpoints" if spec.save_interval else None
        self.run = ArmRun(spec)

    def execute(self) -> ArmRun:
        # a fresh start: an earlier, interrupted run's checkpoints and metrics would be resumed
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.next_kill = 0
        while self.elapsed() < self.budget:
            if not self.one_attempt(len(self.run.attempts)):
                break
        return self.run

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def command(self, k: int, resumed_from: int) -> list[str]:
        args = [*self.job_args, *self.spec.trainer_args,
                "--metrics-file", str(self.workdir / f"metrics.{k}.jsonl")]
        if self.save_dir is not None:
            args += ["--save", str(self.save_dir), "--save-interval", str(self.spec.save_interval)]
            if resumed_from:
                args += ["--load", str(self.save_dir)]
        return [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(self.nproc),
                "--master-port", "0", *self.spec.launcher_args, str(RANK_ENTRY), *args]

    def one_attempt(self, k: int) -> bool:
        """Run launch k until it ends or the budget does; True if a relaunch makes sense."""
        resumed_from = read_latest(self.save_dir)
        attempt = Attempt(started_at=self.elapsed(), resumed_from=resumed_from)
        self.run.attempts.append(attempt)
        pid_dir = self.workdir / f"pids.{k}"
        pid_dir.mkdir(exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "RECOVER_BENCH_PID_DIR": str(pid_dir)}
        metrics = self.workdir / f"metrics.{k}.jsonl"
        self.lines_read = 0
        with open(self.workdir / f"stdout.{k}.log", "w") as log, \
                open(self.workdir / f"stderr.{k}.log", "w") as err:
            proc = subprocess.Popen(self.command(k, resumed_from), cwd=REPO, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=err, start_new_session=True)
            # lets a supervisor (the CI test) kill this launch's session if the benchmark itself dies
            (self.workdir / f"launcher.{k}.pid").write_text(str(proc.pid))
            reader = StdoutReader(proc.stdout, self.t0, self.run.log_lines, log)
            reader.start()
            try:
                self.supervise(proc, attempt, metrics, pid_dir, k)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                reader.join(timeout=5)
        self.read_new_records(metrics, attempt)
        attempt.ended_at = min(self.elapsed(), self.budget)
        if self.spec.stop_after_records is not None and len(attempt.records) >= self.spec.stop_after_records:
            return False
        if attempt.exit_code == 0:
            return False  # the job finished its --train-iters: nothing left to run
        if attempt.exit_code is not None and not attempt.records:  # no kill hit it: kills wait for training
            raise RuntimeError(f"arm {self.spec.name}: launch {k} failed with exit status "
                               f"{attempt.exit_code} before training; see {self.workdir}")
        return True

    def supervise(self, proc, attempt: Attempt, metrics: Path, pid_dir: Path, k: int) -> None:
        while True:
            self.read_new_records(metrics, attempt)
            if self.elapsed() >= self.budget or (self.spec.stop_after_records is not None
                                                 and len(attempt.records) >= self.spec.stop_after_records):
                return  # exit_code stays None: stopped by the benchmark
            code = proc.poll()
            if code is not None:
                attempt.exit_code = code
                return
            self.maybe_kill(attempt, pid_dir, k)
            time.sleep(POLL_SECONDS)

    def maybe_kill(self, attempt: Attempt, pid_dir: Path, k: int) -> None:
        """Fire the next scheduled kill once it is due and the job is training (a kill due during
        start-up waits for the first iteration of the launch: failures hit training, not boot)."""
        if not self.spec.inject_failures or self.next_kill >= len(self.schedule.times):
            return
        if self.elapsed() < self.schedule.times[self.next_kill] or attempt.first_record_at is None:
            return
        live = live_rank_pids(pid_dir)
        if not live:
            return
        rank = self.schedule.victim(self.next_kill, sorted(live))
        try:
            os.kill(live[rank], signal.SIGKILL)
        except ProcessLookupError:
            return  # it just exited: try again next poll
        self.run.kills.append(Kill(at=self.elapsed(), rank=rank, attempt=k))
        self.next_kill += 1

    def read_new_records(self, metrics: Path, attempt: Attempt) -> None:
        if not metrics.exists():
            return
        lines = metrics.read_text().splitlines()
        now = self.elapsed()
        for line in lines[self.lines_read:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line still being written: read it next poll
            self.lines_read += 1
            if "lm_loss" not in rec:
                continue
            record = record_from_metrics(rec, now)
            previous = attempt.records[-1] if attempt.records else None
            attempt.records += unreported_gap(previous, attempt.resumed_from, record) + [record]
            if attempt.first_record_at is None:
                attempt.first_record_at = now
