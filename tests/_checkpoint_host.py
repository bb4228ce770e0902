"""The part of `CheckpointHost` the checkpoint tests' stand-in trainers share: a one-process job
(recovery off, one live replica, no distributed optimizer) around their own model, optimizer,
schedule, progress counters, groups and metrics."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training.checkpointing.state import TrainingState


class OneProcessHost:
    def barrier(self, key: str) -> None:  # the real Trainer's, recovery off
        dist.barrier()

    def any_rank(self, flag: bool, key: str) -> bool:
        return flag

    def weights_ready(self) -> None:  # the real Trainer's without the distributed optimizer
        pass

    @property
    def training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.state, self.groups,
                             torch.device("cpu"))

    @property
    def live_replicas(self) -> list[int]:
        return [0]

    @property
    def membership_epoch(self) -> int:
        return 0

    def close_metrics(self) -> None:
        self.metrics.close()
