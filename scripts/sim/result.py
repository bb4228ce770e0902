"""What a simulated run produced: committed tokens, derived ratios, and the timeline for plots."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scripts.sim.config import SimConfig


class TimelineRecorder:
    """(hours, committed tokens) at every event; tokens grow linearly between consecutive points."""

    def __init__(self) -> None:
        self.hours: list[float] = [0.0]
        self.tokens: list[float] = [0.0]

    def add(self, hours: float, tokens: float) -> None:
        if self.hours[-1] == hours and self.tokens[-1] == tokens:
            return
        self.hours.append(hours)
        self.tokens.append(tokens)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.hours), np.array(self.tokens)


@dataclass(frozen=True)
class SimResult:
    """Outcome of one strategy over config.run_hours of wall clock.

    ETTR here is committed tokens / tokens of the failure-free job of the configured size over the same
    wall time, so it counts lost work, paused time *and* reduced throughput after shrinking.
    GPU-hours are the allocation (job GPUs + spares) times the wall time.
    """

    strategy: str
    config: SimConfig
    tokens: float                 # committed at the end of the run
    iterations: float             # optimizer steps taken (drop: each on a possibly smaller batch)
    failures: int                 # failures that hit the job
    final_replicas: int
    min_batch_fraction: float     # smallest global batch relative to the configured one (drop < 1)
    timeline_hours: np.ndarray = field(repr=False)
    timeline_tokens: np.ndarray = field(repr=False)
    restarts: int = 0
    checkpoints: int = 0

    @property
    def nominal_tokens(self) -> float:
        return self.config.nominal_tokens_per_hour * self.config.run_hours

    @property
    def ettr(self) -> float:
        return self.tokens / self.nominal_tokens

    @property
    def gpu_hours(self) -> float:
        return (self.config.gpus + self.config.spare_gpus) * self.config.run_hours

    @property
    def tokens_per_gpu_hour(self) -> float:
        return self.tokens / self.gpu_hours

    @property
    def trajectory_matches_reference(self) -> bool:
        """Every step used the full global batch (false for drop after a failure)."""
        return self.min_batch_fraction == 1.0

    def tokens_at(self, hours: float) -> float:
        """Committed tokens at a time, interpolated on the timeline (right-continuous at jumps)."""
        index = int(np.searchsorted(self.timeline_hours, hours, side="right")) - 1
        if index >= len(self.timeline_hours) - 1:
            return float(self.timeline_tokens[-1])
        t0, t1 = self.timeline_hours[index], self.timeline_hours[index + 1]
        y0, y1 = self.timeline_tokens[index], self.timeline_tokens[index + 1]
        return float(y0 + (y1 - y0) * (hours - t0) / (t1 - t0))
