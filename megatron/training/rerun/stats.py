"""`--rerun-mode report_stats`, the ReCoVer way: how deterministic is the computation?

Megatron-LM re-runs every iteration in place and records, per validated value, the relative
difference between the two results; every 2 iterations rank 0 logs their distribution. Here the
second computation is another replica's: each iteration one live replica's microbatches (turn
by turn) are re-run by the next live replica, and the two loss sums are compared -- a difference
measures what a different replica, not just a second pass, would compute. With one live replica
it re-runs its own. The cost: one replica's share of extra compute per iteration (Megatron's:
every iteration twice). The log lines are Megatron's.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from megatron.training.rerun import Position, RerunHost

logger = logging.getLogger(__name__)

REPORT_INTERVAL = 2  # Megatron's RerunStateMachine.REPORTING_INTERVAL_ITERATIONS
_PERCENTILES = (0.5, 0.9, 0.99, 0.999)


def relative_difference(a: float, b: float) -> float:
    """Megatron's comparison: 0 when equal (NaN and NaN too), inf when only one is not finite,
    else |a - b| over their mean."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return math.fabs((a - b) / (a + b) * 2)


class DeterminismStats:
    """The recorded differences of one validated value (Megatron's QuickStats' summary)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.identical = 0

    def record(self, difference: float) -> None:
        if difference == 0.0:
            self.identical += 1
        else:
            self.samples.append(difference)

    def summary(self) -> str:
        total, n = self.identical + len(self.samples), len(self.samples)
        if n == 0:
            return f"{self.identical:,} samples, all identical"
        ordered = sorted(self.samples)
        average = sum(ordered) / total
        marks = {p: (f"{ordered[int(total * p) - self.identical]:.3E}"
                     if int(total * p) - self.identical >= 0 else "0.0") for p in _PERCENTILES}
        return (f"{total:,}/{self.identical:,} total/identical samples, rel. variability: avg= "
                f"{average:.3E}, p50= {marks[0.5]}, p90= {marks[0.9]}, p99= {marks[0.99]}, "
                f"p99.9= {marks[0.999]}, max: {ordered[-1]:.3E}")


def compare_once(host: RerunHost, at: Position, assignment: dict[int, list[int]],
                 own_loss: Any) -> float:
    """This iteration's comparison (collective over the replicas; the same value on every
    rank): replica `iteration mod live` re-run by the next live replica."""
    live = list(at.live_replicas)
    turn = at.iteration % len(live)
    compared, validator = live[turn], live[(turn + 1) % len(live)]
    shared = [0.0, 0.0]  # [the re-run's loss sum, the compared replica's own], from last stages
    if at.replica == validator:
        loss = host.rerun(sorted(assignment.get(compared, [])))
        if at.is_last_stage:
            shared[0] = float(torch.as_tensor(loss))
    if at.replica == compared and at.is_last_stage:
        shared[1] = float(torch.as_tensor(own_loss))
    rerun, own = host.share(shared)
    return relative_difference(own, rerun)


def report(stats: DeterminismStats, iteration: int, logging_rank: bool) -> None:
    """Megatron's lines, every REPORT_INTERVAL iterations, from the logging rank."""
    if iteration % REPORT_INTERVAL or not logging_rank:
        return
    logger.info("Stats on computation determinism in validation calls")
    logger.info("  From validation call 'loss':")
    logger.info(f"    {stats.summary()}")
