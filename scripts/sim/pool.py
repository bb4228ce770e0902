"""Healthy idle GPUs available to (re)build replicas, and failed GPUs coming back from repair."""

from __future__ import annotations

import heapq
import math


class GpuPool:
    def __init__(self, healthy: int, repair_hours: float | None) -> None:
        self.healthy = healthy
        self.repair_hours = repair_hours
        self._returns: list[float] = []   # heap of times failed GPUs come back healthy

    def send_to_repair(self, now: float) -> None:
        """A failed GPU; it comes back after repair_hours, or never when repair is not configured."""
        if self.repair_hours is not None:
            heapq.heappush(self._returns, now + self.repair_hours)

    def next_return(self) -> float:
        return self._returns[0] if self._returns else math.inf

    def collect(self, now: float) -> None:
        while self._returns and self._returns[0] <= now:
            heapq.heappop(self._returns)
            self.healthy += 1

    def give(self, count: int) -> None:
        self.healthy += count

    def take(self, wanted: int) -> int:
        """Take up to `wanted` healthy GPUs; returns how many were taken."""
        taken = max(0, min(wanted, self.healthy))
        self.healthy -= taken
        return taken
