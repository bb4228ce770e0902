"""ReCoVer's groups: their backend, their bounds, and the backstop of the watchdog that bounds
NCCL's operations.

`RECOVER_EMULATE_NCCL=1` on the CPU: the emulated NCCL (NCCL's blocking rules over gloo,
docs/NCCL.md §8) instead of gloo, with its host-read rules on the training thread.

Two bounds: `--recover-timeout` T detects failures; `--distributed-timeout-minutes` (Megatron's
bound of process-group set-up, 10 by default) bounds start-up: the first connects and the first
iteration (fused-kernel compiles, autotuning, hundreds of members meeting), which at scale take
longer than T. Megatron-LM likewise uses it until init is done, then
`--distributed-timeout-seconds-after-init`.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from megatron.training.config.run import ParallelConfig

logger = logging.getLogger(__name__)


def resilient_groups(parallel: ParallelConfig, layout, membership, connect: bool, topology):
    """The factory of ReCoVer's groups, with the start-up line that states their bounds."""
    from megatron.training.initialize import resilient_group_factory
    timeout, startup = membership.timeouts.operation, parallel.startup_seconds
    backend = group_backend(parallel.backend, layout)
    if backend != "gloo":
        guard_watchdog(2 * timeout)
    if layout.rank == 0:
        logger.info(f"failures are detected within --recover-timeout {timeout:g} s; start-up "
                    f"(connects, the first iteration) may take --distributed-timeout-minutes "
                    f"{startup / 60:g} ({startup:g} s)")
    return resilient_group_factory(membership, timeout, backend, connect, topology,
                                   startup=startup)


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


def host_sync_counter():
    """The training thread's host reads so far, where the emulated NCCL counts them (each would
    synchronize a GPU's host with its device); None elsewhere."""
    from recover_patches.collectives import emulated_nccl
    return emulated_nccl.host_reads_so_far if emulated_nccl.installed() else None
