"""The training loop's probe: each point marks this rank's progress for the coordinator's verdict
and is a fault-injection point, numbered by the iteration under way (from 1, as in the logs)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from megatron.training.checkpointing.state import Progress
from recover_patches.faults import FaultInjector

Mark = Callable[[str, int | None, int | None], None]  # (where, iteration, microbatch)


def no_mark(where: str, iteration: int | None, microbatch: int | None) -> None:
    pass


@dataclass(frozen=True)
class TrainingProbe:
    progress: Progress  # the trainer's counters, read at each point
    faults: FaultInjector
    mark: Mark = no_mark  # MembershipClient.mark with a coordinator
    ahead: int = 1  # training runs the iteration after those completed

    def at(self, phase: str, microbatch: int | None = None) -> None:
        iteration = self.progress.iteration + self.ahead
        self.mark(phase, iteration, microbatch)
        self.faults.at(phase, iteration, microbatch)

    def of_evaluation(self) -> TrainingProbe:
        """The evaluation after an iteration: its points carry that iteration's number."""
        return dataclasses.replace(self, ahead=0)
