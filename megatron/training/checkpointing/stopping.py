"""Why a job stops early, agreed by every live rank at the end of an iteration:
--exit-interval, --exit-duration-in-mins and, with --exit-signal-handler, a SIGTERM."""
from __future__ import annotations

import signal
import time

from megatron.training.checkpointing.state import CheckpointHost
from megatron.training.config.io import CheckpointConfig


class TrainingStopped(Exception):
    """Every live rank stops after this iteration (--exit-interval, --exit-duration-in-mins, the
    exit signal): the job is done, as if it reached --train-iters (waiting spares are released)."""


# -- SIGTERM: agreed on by all ranks at the end of an iteration -----------------------------------

class TermSignal:
    """Remembers a SIGTERM; `agreed(host)` is true on every rank once any rank got one."""

    def __init__(self) -> None:
        self.received = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        self.received = True

    def agreed(self, host: CheckpointHost) -> bool:
        return host.any_rank(self.received, f"sigterm/{host.training_state.progress.iteration}")


class ExitConditions:
    """The stop conditions of one run (its clock starts when it is built)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.term = TermSignal() if config.exit_signal_handler else None
        self.started = time.monotonic()  # for --exit-duration-in-mins

    def reason(self, host: CheckpointHost) -> str | None:
        """Why every live rank exits after this iteration (the same answer on all of them)."""
        iteration, config = host.training_state.progress.iteration, self.config
        if self.term is not None and self.term.agreed(host):
            return "SIGTERM (--exit-signal-handler)"
        if config.exit_interval and iteration % config.exit_interval == 0:
            return f"--exit-interval {config.exit_interval}"
        if config.exit_duration_in_mins is not None:
            over = (time.monotonic() - self.started) / 60 > config.exit_duration_in_mins
            if host.any_rank(over, f"exit-duration/{iteration}"):  # clocks differ: agree
                return f"--exit-duration-in-mins {config.exit_duration_in_mins:g}"
        return None
