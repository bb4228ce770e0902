"""Stacks of a rank declared dead, for diagnosis (RECOVER_STACKS_BEFORE_FENCE=1, set by the GPU
harness). A rank the coordinator declares may have been healthy and only blocked (a driver
lock, a collective no peer will join), and once fenced or exited its stacks are gone: its
launcher dumps them before the SIGKILL, and the rank itself before it exits on learning the
verdict, whichever comes first."""
from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

logger = logging.getLogger(__name__)
ENV = "RECOVER_STACKS_BEFORE_FENCE"


def wanted() -> bool:
    return bool(os.environ.get(ENV))


def native(pid: int, who: str) -> None:
    """Every thread's native and Python stack of `pid`, into this process's log, where `py-spy`
    is on the PATH."""
    if not shutil.which("py-spy"):
        return
    try:
        dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)],
                              timeout=20, capture_output=True, text=True)
        logger.info(f"{who}'s stacks:\n{dump.stdout}{dump.stderr}")
    except subprocess.TimeoutExpired:
        logger.info(f"{who}'s stacks: py-spy took over 20 s")


def of_rank(pid: int, who: str) -> None:
    """If asked for: a rank's, from its launcher: its Python stacks into its stderr (faulthandler
    on SIGUSR2), then its native ones. A stopped rank takes the SIGUSR2 only if continued; py-spy
    reads it."""
    if not wanted():
        return
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        return
    native(pid, who)
    time.sleep(1.0)  # the faulthandler's write


def of_self(who: str) -> None:
    """If asked for: this process's, before it exits."""
    if not wanted():
        return
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    native(os.getpid(), who)
