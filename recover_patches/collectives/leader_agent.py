"""A launcher's part in the election of the job's coordinator (every node can lead).

Each launcher runs one `LeaderAgent`. Every `ttl / 3` seconds it takes one step:
  * leading: renew the lease. If the renewal fails (the lease lapsed: this node was paused or cut
    off from etcd's majority), or etcd has not answered for a TTL, another node may already lead:
    stop this coordinator at once (fencing: two coordinators must never decide at once), then
    campaign again like any follower;
  * following: campaign. Winning starts a coordinator here, as a successor (`restarted`: the
    ranks bring their latest epoch records, as when node 0's coordinator restarts) unless no
    leader ran the job before (etcd's record says). Losing reads who leads.
A standby node's agent does not campaign (`candidate=False`): it only follows.
Whoever leads, the agent writes its address (host:port) to `address_file`, a node-local file
the node's ranks and the launcher's own link read when they have lost the coordinator: they
reconnect to the new leader instead of the old address.

The election itself (the lease, the fencing by revision) is `election.py`'s; this is the loop
around it, with the coordinator's process behind two callables so it is tested without one.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from recover_patches.collectives.election import Leadership
from recover_patches.collectives.etcd_cluster import ClusterUnreachable

logger = logging.getLogger(__name__)


class Elector(Protocol):
    """What the agent uses of `election.Election` (tests pass an in-memory one)."""
    ttl: int

    def campaign(self, node: str, address: str) -> Leadership | None: ...

    def keep(self, leadership: Leadership) -> bool: ...

    def resign(self, leadership: Leadership) -> None: ...

    def leader(self) -> Leadership | None: ...

    def write(self, leadership: Leadership, name: str, record: dict) -> bool: ...

    def read(self, name: str) -> dict | None: ...


class LeaderAgent:
    def __init__(self, election: Elector, node: str, address: str, address_file: Path,
                 start_coordinator: Callable[[bool], None], stop_coordinator: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, candidate: bool = True):
        self.election, self.node, self.address = election, node, address
        self.candidate = candidate  # False: a standby node's agent only follows who leads
        self.address_file, self.clock = address_file, clock
        self._renewed_at = 0.0  # the last renewal etcd confirmed (the lease runs from there)
        self._start, self._stop_coordinator = start_coordinator, stop_coordinator
        self.leading: Leadership | None = None
        self._last: Leadership | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> None:
        """One round of keeping, campaigning or following. A leader that cannot reach etcd
        leads on until its lease may have lapsed (a TTL after its last confirmed renewal: an etcd
        member's death, or its Raft election, must not stop the job's coordinator), then stops;
        a follower that cannot reach etcd just waits."""
        try:
            if self.leading is not None:
                if not self.election.keep(self.leading):
                    self._depose("its lease lapsed")
                else:
                    self._renewed_at = self.clock()
            if self.leading is None:
                self._campaign()
        except ClusterUnreachable as e:
            if self.leading is not None and self.clock() - self._renewed_at >= self.election.ttl:
                self._depose(f"etcd unreachable for its lease's TTL ({str(e)[:80]})")

    def _campaign(self) -> None:
        won = self.election.campaign(self.node, self.address) if self.candidate else None
        current = won or self.election.leader()
        if current is not None and current != self._last:
            self._last = current
            self._publish(current.address)
        if won is None:
            return
        self.leading, self._renewed_at = won, self.clock()
        successor = self.election.read("started") is not None  # an earlier leader ran the job
        self.election.write(won, "started", {"node": self.node, "revision": won.revision})
        logger.info(f"node {self.node} leads (revision {won.revision}): "
                    f"{'a successor ' if successor else ''}coordinator at {self.address}")
        self._start(successor)

    def _depose(self, why: str) -> None:
        logger.warning(f"node {self.node} no longer leads: {why}; stopping its coordinator")
        self.leading = None
        self._stop_coordinator()

    def _publish(self, address: str) -> None:
        """Atomically: a reader sees the old address or the new one, never half of one."""
        staging = self.address_file.with_suffix(".tmp")
        staging.write_text(address)
        os.replace(staging, self.address_file)

    # --- the thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self.step()  # the first round before any rank starts: the address file exists
        self._thread = threading.Thread(target=self._run, name="recover-leader-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.election.ttl / 3):
            self.step()

    def close(self) -> None:
        """A clean exit: stop the loop and hand the leadership over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.leading is not None:
            try:
                self.election.resign(self.leading)
            except ClusterUnreachable:
                pass  # it lapses after its TTL
            self.leading = None
