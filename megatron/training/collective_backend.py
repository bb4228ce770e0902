"""Which backend ReCoVer's groups run on, and the backstop of the watchdog that bounds NCCL's.

`RECOVER_EMULATE_NCCL=1` on the CPU: the emulated NCCL (NCCL's blocking rules over gloo,
docs/NCCL.md §8) instead of gloo, with its host-read rules on the training thread.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)


def group_backend(flag: str, layout) -> str:
    """`--distributed-backend`'s kind, or the emulated NCCL where it is asked for on a CPU."""
    from recover_patches.collectives import emulated_nccl
    if not emulated_nccl.requested():
        return flag
    if layout.device != "cpu":
        logger.info(f"{emulated_nccl.ENV_VAR}: ignored on a GPU, which runs the real NCCL")
        return flag
    if layout.rank == 0:
        logger.info(f"{emulated_nccl.ENV_VAR}=1: ReCoVer's groups run on the emulated NCCL "
                    "(gloo underneath; host reads wait for the communicators, docs/NCCL.md)")
    return emulated_nccl.install()


def guard_watchdog(limit: float) -> None:
    """NCCL's collectives are bounded by ReCoVer's watchdog thread alone: if it is stuck or dead
    for `limit` seconds with operations pending, this rank ends itself (like a crash), so the
    coordinator declares it dead and the others go on, rather than everyone hanging with it."""
    from recover_patches.collectives.watchdog import WATCHDOG

    def fence(why: str) -> None:
        logger.error(f"fencing this rank: {why}")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    WATCHDOG.guard(limit, fence)
