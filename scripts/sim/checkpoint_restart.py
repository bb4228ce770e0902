"""Checkpoint-restart (`checkpoint_restart`): the stock Megatron behaviour.

The job computes, and after every `interval_hours` of compute pauses `checkpoint_save_seconds` to save.
A failure while computing, saving or restarting kills the job: progress rolls back to the last
completed checkpoint, the failed GPU goes to repair, and the job restarts (`restart_seconds` +
`checkpoint_load_seconds`, during which it can fail again) once it holds enough healthy GPUs:
* a spare replaces the failed GPU at once -> restart at full size;
* no spare but repair configured -> wait (idle) until repaired GPUs make the full size again;
* neither -> restart on the whole replicas its healthy GPUs still form (assumption: the job can be
  relaunched with a smaller data-parallel size and the same global batch); none left -> the run is over.
"""

from __future__ import annotations

import math

from scripts.sim.config import SimConfig
from scripts.sim.failures import FailureTrace
from scripts.sim.pool import GpuPool
from scripts.sim.result import SimResult, TimelineRecorder

RUNNING, SAVING, RESTARTING, WAITING, DEAD = "running", "saving", "restarting", "waiting", "dead"
_ACTIVE = (RUNNING, SAVING, RESTARTING)


class _Job:
    """Mutable state of the checkpoint-restart job between events."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.pool = GpuPool(config.spare_gpus, config.repair_hours)
        self.held = config.gpus            # healthy GPUs the job holds (busy or idle)
        self.replicas = config.dp
        self.phase, self.phase_end = RUNNING, math.inf
        self.compute_since_save = 0.0
        self.tokens = self.saved_tokens = self.saving_tokens = 0.0
        self.restarts = self.checkpoints = self.failures = 0

    def acquire_and_restart(self, now: float) -> None:
        cfg = self.config
        self.pool.collect(now)
        self.held += self.pool.take(cfg.gpus - self.held)
        if self.held >= cfg.gpus:
            self.replicas = cfg.dp
        elif cfg.repair_hours is not None:
            self.phase, self.phase_end = WAITING, math.inf
            return
        else:
            self.replicas = self.held // cfg.replica_gpus
            if self.replicas == 0:
                self.phase, self.phase_end = DEAD, math.inf
                return
        self.phase, self.phase_end = RESTARTING, now + cfg.restart_total_hours
        self.restarts += 1

    def fail(self, now: float) -> None:
        self.failures += 1
        self.tokens = self.saved_tokens
        self.held -= 1
        self.pool.send_to_repair(now)
        self.acquire_and_restart(now)

    def next_transition(self, now: float, interval: float) -> float:
        if self.phase == RUNNING:
            return now + max(0.0, interval - self.compute_since_save)
        if self.phase == WAITING:
            return self.pool.next_return()
        return self.phase_end

    def transition(self, now: float) -> None:
        if self.phase == RUNNING:
            self.phase, self.phase_end = SAVING, now + self.config.checkpoint_save_seconds / 3600.0
            self.saving_tokens = self.tokens
        elif self.phase == SAVING:
            self.saved_tokens = self.saving_tokens
            self.checkpoints += 1
            self.phase, self.compute_since_save = RUNNING, 0.0
        elif self.phase == RESTARTING:
            self.phase, self.compute_since_save = RUNNING, 0.0
        elif self.phase == WAITING:
            self.acquire_and_restart(now)


def simulate_checkpoint_restart(config: SimConfig, trace: FailureTrace) -> SimResult:
    job, interval = _Job(config), config.interval_hours
    now, next_failure = 0.0, 0
    timeline = TimelineRecorder()
    while True:
        failure_at = trace.times_hours[next_failure] if next_failure < len(trace) else math.inf
        transition_at = job.next_transition(now, interval)
        upcoming = min(failure_at, transition_at, config.run_hours)
        if job.phase == RUNNING:
            elapsed = upcoming - now
            job.tokens += elapsed * config.nominal_tokens_per_hour * job.replicas / config.dp
            job.compute_since_save += elapsed
        now = upcoming
        timeline.add(now, job.tokens)
        if now >= config.run_hours:
            break
        if now == failure_at:
            next_failure += 1
            if job.phase in _ACTIVE and trace.hits(next_failure - 1, job.replicas * config.replica_gpus):
                job.fail(now)
        else:
            job.transition(now)
        timeline.add(now, job.tokens)

    hours, committed = timeline.arrays()
    return SimResult(
        strategy="checkpoint_restart", config=config, tokens=job.tokens,
        iterations=job.tokens / config.tokens_per_iteration, failures=job.failures,
        final_replicas=job.replicas if job.phase != DEAD else 0,
        min_batch_fraction=1.0, timeline_hours=hours, timeline_tokens=committed,
        restarts=job.restarts, checkpoints=job.checkpoints)
