"""Megatron's fault-tolerance flags, the ReCoVer way: --enable-ft-package, --calc-ft-timeouts,
--ft-num-warmup-iters.

Megatron-LM hands hang detection to NVIDIA Resiliency Extension: its rank monitors time the
training's sections, and with --calc-ft-timeouts set each timeout to 5 x the longest interval
they saw (its safety factor), kept in SAVE/ft_state.json for the next run. ReCoVer detects dead
and hung ranks itself, with one timeout (--recover-timeout: how long a rank may keep the others
waiting). So here:
  --enable-ft-package  the next run's --recover-timeout comes from SAVE/recover_timeout.json when
                       a run with --calc-ft-timeouts wrote one (every rank reads the same file, so
                       they agree, as the coordinator requires);
  --calc-ft-timeouts   rank 0 times the intervals between iterations' ends (a save included),
                       skipping the first --ft-num-warmup-iters, and after each save and at the
                       end writes 5 x the longest (at least 1 s) to that file.
"""
from __future__ import annotations

import json
import logging
import time

from megatron.training.checkpointing.files import write_atomically
from megatron.training.config.io import FtConfig

logger = logging.getLogger(__name__)

SAFETY_FACTOR = 5.0  # NVIDIA Resiliency Extension's: a timeout is 5 x the longest interval seen
MIN_TIMEOUT = 1.0  # --recover-timeout's least value


def recover_timeout(config: FtConfig, flag_value: float, rank: int) -> float:
    """--recover-timeout, or the stored one with --enable-ft-package."""
    path = config.state_file
    if path is None or not path.is_file():
        return flag_value
    try:
        stored = float(json.loads(path.read_text())["recover_timeout"])
    except (OSError, ValueError, KeyError, TypeError):
        return flag_value  # a torn or foreign file: keep the flag's value
    if rank == 0:
        logger.info(f"--recover-timeout {stored:g} from {path} (measured by --calc-ft-timeouts; "
                    f"the flag's {flag_value:g} is not used)")
    return max(stored, MIN_TIMEOUT)


class TimeoutRecorder:
    """--calc-ft-timeouts on rank 0: the longest interval between iterations' ends."""

    def __init__(self, config: FtConfig) -> None:
        self.config = config
        self.ends = 0
        self.last: float | None = None
        self.longest = 0.0

    def iteration_ended(self) -> None:
        now = time.monotonic()
        self.ends += 1
        if self.last is not None and self.ends > max(self.config.warmup_iters, 1):
            self.longest = max(self.longest, now - self.last)
        self.last = now

    def store(self) -> float | None:
        """Write the derived timeout (after a save, at the end); None: nothing measured yet."""
        path = self.config.state_file
        if path is None or self.longest <= 0:
            return None
        timeout = max(SAFETY_FACTOR * self.longest, MIN_TIMEOUT)
        write_atomically(path, json.dumps({
            "recover_timeout": timeout, "longest_interval_s": self.longest,
            "safety_factor": SAFETY_FACTOR, "iterations_seen": self.ends}, indent=1).encode())
        logger.info(f"--calc-ft-timeouts: --recover-timeout {timeout:.1f} s for the next run "
                    f"({SAFETY_FACTOR:g} x the longest interval, {self.longest:.3f} s) in {path}")
        return timeout
