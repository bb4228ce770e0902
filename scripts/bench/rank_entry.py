"""Rank entry point for the effective-throughput benchmark: records this rank's PID, then runs
pretrain_gpt_recover.py unchanged.

Why: the launcher forks ranks from a warm parent without exec, so a rank's RANK variable never
shows in /proc/<pid>/environ. To SIGKILL "rank R" from outside, the benchmark passes this script
to the launcher instead of the trainer; it writes `$RECOVER_BENCH_PID_DIR/rank<R>.pid` and hands
over to the trainer (same argv, same `__main__`, same exit status).
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "pretrain_gpt_recover.py"


def record_pid() -> None:
    pid_dir = os.environ.get("RECOVER_BENCH_PID_DIR")
    if not pid_dir:
        return
    path = Path(pid_dir) / f"rank{os.environ['RANK']}.pid"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, path)  # the benchmark never reads a half-written file


if __name__ == "__main__":
    record_pid()
    sys.argv[0] = str(TRAINER)
    runpy.run_path(str(TRAINER), run_name="__main__")
