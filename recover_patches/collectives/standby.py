"""A standby process's wait for a slot (DESIGN §15): the one thing it does before it is a rank.

A standby node's launcher (`launch --standby`) starts processes with no rank: RECOVER_STANDBY
names each one. Such a process tells the coordinator it waits, then blocks on its own queue until
the coordinator gives it the slot of a dead rank (a lost node's: no local replacement is coming),
or says the job completed or stopped. If the coordinator dies meanwhile, it waits (up to
RECONNECT_WITHIN) for the one the node-0 launcher starts in its place and registers again. With a
slot it becomes that rank's replacement: RANK and
RECOVER_INCARNATION are set in its environment and it starts as a spare, like a process its
launcher replaced (the rest of its environment, LOCAL_RANK and so its GPU, is its own node's).
"""
from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.errors import CoordinatorConfigError, CoordinatorUnreachable
from recover_patches.collectives.timeouts import RECONNECT_WITHIN

ENV_VAR = "RECOVER_STANDBY"
WAIT = timedelta(days=30)  # a standby may wait for the whole job: the coordinator ends the wait


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
    """Register as a waiting standby and block until the coordinator decides. Needs
    RECOVER_COORDINATOR and RECOVER_JOB_TOKEN (set by the launcher)."""
    address, token = os.environ.get("RECOVER_COORDINATOR"), os.environ.get("RECOVER_JOB_TOKEN")
    if not address or not token:
        raise CoordinatorConfigError(f"{ENV_VAR} is set but RECOVER_COORDINATOR / RECOVER_JOB_TOKEN "
                                     "are not: start standby processes with `python -m "
                                     "recover_patches.launch --standby`")
    host, port = P.parse_address(address, "RECOVER_COORDINATOR")
    timeout, lost_at, connected = connect_timeout, None, False
    while True:
        try:
            raw = P.connect(host, port, timeout, "RECOVER_COORDINATOR")
            connected = True
            raw.set_timeout(WAIT)
            store = dist.PrefixStore(P.job_prefix(token), raw)
            P.post_report(store, P.Report.make("standby", id=standby))
            answer = store.queue_pop(P.standby_key(standby), True).decode()
            break
        except (CoordinatorUnreachable, RuntimeError) as e:  # gone: a successor may come
            if not connected:
                raise
            lost_at = lost_at or time.monotonic()
            if time.monotonic() - lost_at > RECONNECT_WITHIN:
                raise CoordinatorUnreachable(f"standby {standby} lost the coordinator: {e}") from e
            timeout = 2.0
            time.sleep(0.2)
    if answer == P.COMPLETE:
        return JobEnded.COMPLETE
    if answer == P.STOPPED:
        return JobEnded.STOPPED
    slot = json.loads(answer)
    return SlotAssignment(int(slot["rank"]), int(slot["incarnation"]))


def become(assignment: SlotAssignment) -> None:
    """Take the slot: from here on this process is that rank's replacement. RECOVER_STANDBY
    stays: the process names itself with it when it registers for the slot."""
    os.environ["RANK"] = str(assignment.rank)
    os.environ["RECOVER_INCARNATION"] = str(assignment.incarnation)
