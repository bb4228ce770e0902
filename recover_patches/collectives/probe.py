"""The probe: the points in a step where this rank says where it is.

Each point does two things, both off unless the job asks for them: it marks progress for the
coordinator's verdict on a stuck rank, and it is a fault-injection point (`--inject-fault`). The
pipeline engine, the transaction, the join and the groups call `probe.at(phase, microbatch)`;
only the trainer knows the iteration, the coordinator link and the faults behind it.
"""
from __future__ import annotations

from typing import Protocol


class Probe(Protocol):
    def at(self, phase: str, microbatch: int | None = None) -> None:
        """This rank reached `phase` (of microbatch `microbatch`) in the current iteration."""
        ...


class _Silent:
    """No marks and no faults: code run outside a job (tests, benchmarks, tools)."""

    def at(self, phase: str, microbatch: int | None = None) -> None:
        pass


NO_PROBE: Probe = _Silent()
