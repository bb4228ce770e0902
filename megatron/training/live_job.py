"""The running job as checkpoints and joins see it: who is live, the job-wide meeting points
(resilient when recovery is on), this rank's training state, its groups and the state a donor
sends. It is the `CheckpointHost` of `checkpointing` and the `ReplicaState` of growing back, so
the Trainer keeps only the loop, the records and evaluation."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing.state import Progress, TrainingState
from megatron.training.initialize import ParallelGroups
from megatron.training.metrics import MetricsWriter
from megatron.training.optimizer import Optimizer
from megatron.training.step.replica import GPTReplicaStep
from megatron.training.step.state_transfer import receive_state, send_state
from recover_patches.collectives import Regrouped
from recover_patches.faults import FaultInjector
from recover_patches.recovery.agreement import StoreAgreement
from recover_patches.recovery.grad_buffer import GradBuffer
from recover_patches.recovery.iteration import LiveReplicas


@dataclass
class LiveJob:
    live: LiveReplicas
    replica: GPTReplicaStep  # this rank's part of its replica
    groups: ParallelGroups
    agreement: StoreAgreement | None  # recovery on
    faults: FaultInjector
    metrics: MetricsWriter
    model: torch.nn.Module
    optimizer: Optimizer
    scheduler: OptimizerParamScheduler
    progress: Progress  # the Trainer's counters: one object, updated in place
    grads: GradBuffer
    records: deque  # the Trainer's metrics records, newest last: a join moves the last few

    # -- CheckpointHost ---------------------------------------------------------------------
    @property
    def training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.progress,
                             self.groups, self.grads.device, self.grads.scales)

    @property
    def live_replicas(self) -> list[int]:
        return list(self.live.live_replicas)

    @property
    def membership_epoch(self) -> int:
        return self.live.epoch

    def barrier(self, key: str) -> None:
        """All ranks of the live replicas meet (PeerFailure if one dies meanwhile)."""
        if self.agreement is None:
            dist.barrier()
        else:
            self.agreement.barrier(f"sync/{key}", self.live.members(), self.live.epoch)

    def any_rank(self, flag: bool, key: str) -> bool:
        """True on every live rank iff any of them passes True."""
        if self.agreement is None:
            t = torch.tensor([int(flag)], dtype=torch.int32, device=self.grads.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())
        return self.agreement.any_flag(key, self.live.members(), self.live.epoch, flag)

    def weights_ready(self) -> None:
        self.replica.weights_ready()

    def close_metrics(self) -> None:
        self.metrics.close()

    # -- ReplicaState (what a join moves) ---------------------------------------------------
    def abandon(self, phase: str) -> None:
        self.groups.abandon(phase)

    def rebuild(self, live_replicas: list[int], epoch: int, key: str) -> Regrouped:
        return self.replica.rebuild(live_replicas, epoch, key)

    def send_state(self, replica: int) -> int:
        self.weights_ready()
        return send_state(self.training_state, self.replica.timings, replica, self.records)

    def receive_state(self, replica: int) -> int:
        received, timings, records = receive_state(self.training_state, replica)
        self.replica.adopt_timings(timings)  # every replica plans alike from the next iteration
        self.records.clear()  # the job's, not those from before this rank's replica broke
        self.records.extend(records)
        self.grads.zero()  # whatever a spare had accumulated when its replica broke
        return received
