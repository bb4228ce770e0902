"""Every wait of the failure path, derived from one knob: `--recover-timeout` (design.md §6).

T (`operation`) is how long a rank may keep its peers waiting: an operation that makes no
progress for T fails. Everything else follows from T so that the waits agree:

  heartbeat_interval  how often a rank's heartbeat (and its progress marks) reach the store;
  stall               T + GRACE: a rank whose heartbeat, or -- while others report a timeout --
                      whose progress, has not moved for this long is declared dead. GRACE covers
                      the time between a waiter's timeout and its report reaching the coordinator,
                      so a rank that is itself waiting is never mistaken for the one stuck;
  verdict_wait        how long a rank that saw a failure waits for the coordinator's verdict: the
                      stuck rank's last progress is at most T before the waiter's timeout, so the
                      verdict comes within stall + one heartbeat interval (+ a margin) of it;
  standby_grace, register_timeout  the coordinator's waits before it gives a dead slot to a
                      standby process, and for that process to register.

A hang is thus seen T + GRACE + at most one heartbeat interval after the rank stopped moving,
i.e. T + <= 0.9 s, for any T >= 1 s. Where a launcher forwards its node's beats (`node_beats.py`),
a rank replaces its local beat 8 times per interval and the launcher forwards once: a death is
still seen within T + GRACE + one interval of the last beat, a stop of progress within an eighth
of an interval more (T + <= 0.95 s), both within `verdict_wait`'s margin.
"""
from __future__ import annotations

from dataclasses import dataclass

GRACE = 0.5  # seconds: a waiter's report reaches the coordinator well within this
RECONNECT_WITHIN = 60.0  # seconds ranks, launchers and standbys wait for a restarted coordinator
MARGIN = 0.5  # seconds: the coordinator's tick, scheduling delays on a loaded machine
MIN_OPERATION = 1.0
OPERATION_WAIT = 2.0  # seconds: over a cut link a launcher's or standby's store operation is
# given up after this (`bounded_call.py`)
REPORT_WAIT = 2.0  # seconds a failure report may take (a cut link never answers: bounded_call.py)


@dataclass(frozen=True)
class Timeouts:
    operation: float  # T, --recover-timeout

    def __post_init__(self):
        if not self.operation >= MIN_OPERATION:
            raise ValueError(f"--recover-timeout {self.operation:g}: must be >= {MIN_OPERATION:g} s "
                             "(a heartbeat must be able to move several times within it)")

    @property
    def heartbeat_interval(self) -> float:
        return min(0.4, max(0.1, self.operation / 10))

    @property
    def stall(self) -> float:
        return self.operation + GRACE

    @property
    def verdict_wait(self) -> float:
        return self.operation + GRACE + self.heartbeat_interval + MARGIN

    @property
    def standby_grace(self) -> float:
        """How long a dead slot's launcher may take to report a local replacement before the slot
        goes to a standby: it fences and reports within a fraction of a second when alive."""
        return max(1.0, 2 * self.heartbeat_interval)

    @property
    def register_timeout(self) -> float:
        """How long a standby given a slot may take to register before it goes to another."""
        return self.stall + 10.0
