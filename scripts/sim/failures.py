"""Failure arrivals, drawn once per seed and shared by every strategy (common random numbers).

Rate mode: a Poisson process at the rate of *all* job GPUs (gpus / gpu_mtbf_hours). An arrival only
hits the job with probability active_gpus / gpus (thinning), where active means "running the job right
now" (live replicas, or the whole job while it computes, saves or restarts). This gives exactly the rate
active_gpus / gpu_mtbf_hours whatever a strategy's state, while all strategies see the same draws.
Idle GPUs (spares, GPUs waiting for a restart or a repair) are assumed not to fail.

Trace mode: failure_times_hours lists failures of running GPUs; each one hits the job if anything is
running at that time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scripts.sim.config import SimConfig


@dataclass(frozen=True)
class FailureTrace:
    times_hours: np.ndarray
    accept_draws: np.ndarray | None   # uniform [0, 1) per arrival; None in trace mode
    job_gpus: int

    def __len__(self) -> int:
        return len(self.times_hours)

    def hits(self, index: int, active_gpus: int) -> bool:
        """Whether arrival `index` strikes one of the `active_gpus` GPUs running the job."""
        if active_gpus <= 0:
            return False
        if self.accept_draws is None:
            return True
        return bool(self.accept_draws[index] * self.job_gpus < active_gpus)


def make_trace(config: SimConfig, seed: int) -> FailureTrace:
    if config.failure_times_hours is not None:
        times = np.array([t for t in config.failure_times_hours if t < config.run_hours], dtype=float)
        return FailureTrace(times, None, config.gpus)
    if config.gpu_mtbf_hours is None or np.isinf(config.gpu_mtbf_hours):
        return FailureTrace(np.zeros(0), None, config.gpus)
    rng = np.random.default_rng(seed)
    mean_gap = config.gpu_mtbf_hours / config.gpus
    chunk = int(config.run_hours / mean_gap * 1.2) + 16
    times = np.cumsum(rng.exponential(mean_gap, size=chunk))
    while times[-1] < config.run_hours:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(mean_gap, size=chunk))])
    times = times[times < config.run_hours]
    return FailureTrace(times, rng.random(len(times)), config.gpus)
