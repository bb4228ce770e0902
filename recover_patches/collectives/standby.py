"""A standby process's wait for a slot (design.md §11): the one thing it does before it is a rank.

A standby node's launcher (`launch --standby`) starts processes with no rank: RECOVER_STANDBY
names each one. Such a process tells the coordinator it waits, then polls its own queue until
the coordinator gives it the slot of a dead rank (a lost node's: no local replacement is coming),
or says the job completed or stopped. If the coordinator dies meanwhile, it waits (up to
RECONNECT_WITHIN) for the one the node-0 launcher starts in its place, or the one etcd
elects on another node, and registers again there. With a slot it becomes that rank's
replacement: RANK and RECOVER_INCARNATION are set in its environment and it starts as a spare,
like a process its launcher replaced (the rest of its environment, LOCAL_RANK and so its GPU, is its own node's).
"""
from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.bounded_call import BoundedCaller
from recover_patches.collectives.errors import CoordinatorConfigError, CoordinatorUnreachable
from recover_patches.collectives.timeouts import OPERATION_WAIT, RECONNECT_WITHIN

ENV_VAR = "RECOVER_STANDBY"
POLL_EVERY = 0.5  # seconds between a waiting standby's looks at its queue (one store operation)
ATTEMPT = 2.0  # seconds one connection attempt may take before the address is read again


class JobEnded(enum.Enum):
    """Why a standby was sent home without a slot."""
    COMPLETE = "complete"  # the job finished: exit 0
    STOPPED = "stopped"    # no live replica was left to re-form: exit with the restart status


@dataclass(frozen=True)
class SlotAssignment:
    rank: int
    incarnation: int


def standby_id() -> str | None:
    """This process's standby name, or None for an ordinary rank."""
    return os.environ.get(ENV_VAR) or None


def wait_for_slot(standby: str, connect_timeout: float = 30.0) -> SlotAssignment | JobEnded:
    """Register as a waiting standby and poll until the coordinator decides. Needs
    RECOVER_COORDINATOR and RECOVER_JOB_TOKEN (set by the launcher); with RECOVER_COORDINATOR_FILE
    (an elected coordinator) it follows the address that file names, from the start: a
    standby may come up while the coordinator it was told of is gone and etcd elects the next,
    so the first connection waits as long as a lost one does (RECONNECT_WITHIN)."""
    address, token = os.environ.get("RECOVER_COORDINATOR"), os.environ.get("RECOVER_JOB_TOKEN")
    if not address or not token:
        raise CoordinatorConfigError(f"{ENV_VAR} is set but RECOVER_COORDINATOR / RECOVER_JOB_TOKEN "
                                     "are not: start standby processes with `python -m "
                                     "recover_patches.launch --standby`")
    fallback = P.parse_address(address, "RECOVER_COORDINATOR")
    file = os.environ.get("RECOVER_COORDINATOR_FILE")
    where = lambda: P.current_address(Path(file) if file else None, *fallback)  # noqa: E731
    patience = connect_timeout if file is None else max(connect_timeout, RECONNECT_WITHIN)
    bounded = BoundedCaller(OPERATION_WAIT, f"recover-standby-{standby}")
    lost_at: float | None = time.monotonic()  # not reached yet: as good as lost
    reached = False
    while True:
        at = where()
        try:  # short attempts: between them the address file may name a successor
            store = _register(at, token, standby, bounded, min(ATTEMPT, connect_timeout))
            lost_at, reached = None, True
            answer = _poll(store, standby, bounded, moved=lambda: where() != at)
            if answer is not None:
                break
        except (CoordinatorUnreachable, RuntimeError) as e:  # gone: a successor may come
            if lost_at is None:
                lost_at, patience = time.monotonic(), RECONNECT_WITHIN
            if time.monotonic() - lost_at > patience:
                what = "lost" if reached else "could not reach"
                raise CoordinatorUnreachable(f"standby {standby} {what} the coordinator: {e}") from e
            time.sleep(0.2)
    bounded.close()
    if answer == P.COMPLETE:
        return JobEnded.COMPLETE
    if answer == P.STOPPED:
        return JobEnded.STOPPED
    slot = json.loads(answer)
    return SlotAssignment(int(slot["rank"]), int(slot["incarnation"]))


def _register(at: tuple[str, int], token: str, standby: str, bounded: BoundedCaller,
              attempt: float) -> dist.Store:
    """Connect to the coordinator at `at` and say this standby waits there."""
    raw = P.connect(*at, attempt, "RECOVER_COORDINATOR", quick=True)
    store = dist.PrefixStore(P.job_prefix(token), raw)
    bounded(lambda: P.post_report(store, P.Report.make("standby", id=standby)))
    return store


def _poll(store: dist.Store, standby: str, bounded: BoundedCaller,
          moved: Callable[[], bool]) -> str | None:
    """The coordinator's answer, or None once the address file names another coordinator (the
    standby registers there). Polled, not a blocking pop: a pop would wait on a coordinator that
    lost its election, or sits behind a cut link, while the successor has the answer. Each look
    is bounded: over a cut link a store's reply never comes (`bounded_call.py`)."""
    while not moved():
        try:
            return bounded(lambda: store.queue_pop(P.standby_key(standby), False)).decode()
        except dist.QueueEmptyError:
            time.sleep(POLL_EVERY)
    return None


def become(assignment: SlotAssignment) -> None:
    """Take the slot: from here on this process is that rank's replacement. RECOVER_STANDBY
    stays: the process names itself with it when it registers for the slot."""
    os.environ["RANK"] = str(assignment.rank)
    os.environ["RECOVER_INCARNATION"] = str(assignment.incarnation)
