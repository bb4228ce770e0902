"""The seeded failure schedule every arm of the effective-throughput benchmark shares.

Kill k is due at (k + 1) * interval + jitter (jitter uniform in +-interval/4), and hits the live
rank picked by a seeded uniform draw u_k: the (floor(u_k * live))-th of the ranks still alive.
Same seed -> same times and same draws for every arm; which rank a draw names depends on which
ranks are still alive in that arm (a ReCoVer job has fewer after each kill, a relaunched C/R job
has all of them again).
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureSchedule:
    times: tuple[float, ...]      # seconds after the arm starts
    draws: tuple[float, ...]      # uniform [0, 1) per kill, picks the victim among live ranks

    @classmethod
    def seeded(cls, seed: int, interval: float, budget: float, max_failures: int | None = None
               ) -> "FailureSchedule":
        if interval <= 0:
            raise ValueError(f"failure interval must be > 0 seconds, got {interval}")
        rng = random.Random(seed)
        times, draws, k = [], [], 0
        while True:
            t = (k + 1) * interval + rng.uniform(-interval / 4, interval / 4)
            if t >= budget or (max_failures is not None and len(times) >= max_failures):
                break
            times.append(t)
            draws.append(rng.random())
            k += 1
        return cls(tuple(times), tuple(draws))

    def victim(self, k: int, live_ranks: list[int]) -> int:
        return live_ranks[min(int(self.draws[k] * len(live_ranks)), len(live_ranks) - 1)]
