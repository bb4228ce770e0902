"""The job through its launches: each launch runs until the job completes (status 0), stops
for a checkpoint-restart (status 3: the harness starts the next launch from the last checkpoint,
as SLURM's --requeue would), or makes no progress for the stall limit (a hang: its ranks print
their stacks, it is ended and counted, and the next launch restarts too). Every launch is given
the whole plan: the ledger (RECOVER_FAULT_LEDGER) keeps a fault that fired from firing again."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from scripts.chaos.cluster import ClusterSettings, Injection, Launch
from scripts.chaos.plan import PlannedFault
from scripts.chaos.site import Site

POLL = 0.2  # seconds between looks at the launchers


@dataclass
class LaunchOutcome:
    index: int
    status: int | None  # node 0's launcher's; None: ended by the harness (a hang)
    hung: bool
    started: float  # the harness's clock
    ended: float
    injections: list[Injection]
    records_from: int  # the metrics file's line count when it started
    left: list[str] = field(default_factory=list)  # a hang: the launchers still running then


@dataclass
class JobHistory:
    launches: list[LaunchOutcome] = field(default_factory=list)
    fired: list[tuple[PlannedFault, Injection]] = field(default_factory=list)
    unfired: list[PlannedFault] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return bool(self.launches) and self.launches[-1].status == 0

    @property
    def hangs(self) -> int:
        return sum(launch.hung for launch in self.launches)

    @property
    def restarts(self) -> int:
        return len(self.launches) - 1

    @property
    def unexpected_ends(self) -> int:
        """Launches that ended neither completed (0), nor stopped for a restart (3), nor hung:
        a launcher failed (the soak found a job whose `complete` went unheard end with 1)."""
        return sum(launch.status not in (None, 0, 3) for launch in self.launches)


def lines_in(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def run_launch(launch: Launch, metrics: Path, stall_limit: float,
               progress: Callable[[int], None]) -> tuple[int | None, list[str] | None]:
    """Watch one launch to its end: node 0's status (None: it hung), and for a hang the
    launchers still running then."""
    launch.start()
    last_lines, last_change = lines_in(metrics), time.monotonic()
    while not launch.ended():
        time.sleep(POLL)
        launch.replenish()
        lines = lines_in(metrics)
        if lines != last_lines:
            progress(lines - last_lines)
            last_lines, last_change = lines, time.monotonic()
        elif time.monotonic() - last_change > stall_limit:
            left = launch.running()
            launch.signal_ranks(signal.SIGUSR2)  # their stacks, into their output
            time.sleep(3.0)
            launch.stop()
            return None, left
    launch.stop()  # (what a launcher left in its group)
    progress(lines_in(metrics) - last_lines)
    return launch.owner_status(), None


def take_fired(pending: list[PlannedFault], injections: list[Injection]
               ) -> list[tuple[PlannedFault, Injection]]:
    """Match each fault line to the first pending fault it is; those leave `pending`."""
    fired = []
    for injection in injections:
        match = next((f for f in pending if f.fired_by(injection.rank, injection.kind,
                                                       injection.iteration, injection.phase)),
                     None)
        if match is not None:
            pending.remove(match)
            fired.append((match, injection))
    return fired


def run_job(settings: ClusterSettings, site: Site, faults: list[PlannedFault], metrics: Path,
            directory: Path, stall_limit: float, max_launches: int,
            progress: Callable[[int], None] = lambda _: None) -> JobHistory:
    history, pending = JobHistory(), list(faults)
    for index in range(max_launches):
        launch = Launch(settings, [f.spec() for f in faults], directory / f"launch{index}", site)
        started, records_from = time.monotonic(), lines_in(metrics)
        status, left = run_launch(launch, metrics, stall_limit, progress)
        history.fired += take_fired(pending, launch.injections)
        history.launches.append(LaunchOutcome(index, status, left is not None, started,
                                              time.monotonic(), list(launch.injections),
                                              records_from, left or []))
        if status == 0:
            break
    history.unfired = pending
    return history
