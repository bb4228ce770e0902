"""The coordinator of whichever node etcd elected (`--rdzv-backend etcd`).

Every node's launcher holds an `ElectedCoordinator` in place of node 0's `CoordinatorHandle`:
its `LeaderAgent` campaigns for the job's leader key (a standby node's only follows it: its
processes, waiting for a slot, read the address file too); the winner's launcher forks a coordinator
on its own address (`--local-addr`, a free port unless --coordinator-port), a *successor* one
when an earlier leader ran the job, so the ranks bring their latest epoch records as they do to
a coordinator restarted on node 0. Every agent writes the leader's address into a file of
its node (`RECOVER_COORDINATOR_FILE`), which the node's ranks and its launcher's link read when
they connect again: losing node 0 then costs what a coordinator restart costs, plus the lease's
TTL. A leader that loses its lease stops its coordinator before another can win (fencing).

The coordinator journals each epoch and the completion to etcd before publishing them, fenced by
the lease (`journal.py`): one whose node lost the lease exits at its next decision. The agent's
thread only asks; the launcher's supervision loop starts and stops the process
(`restart_if_dead`, every 0.2 s), so the fork happens on the launcher's main thread.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from recover_patches.collectives.election import Election
from recover_patches.collectives.errors import CoordinatorConfigError
from recover_patches.collectives.etcd_cluster import EtcdCluster, parse_endpoints
from recover_patches.collectives.journal import ElectionJournal
from recover_patches.collectives.launcher_link import CoordinatorHandle, LauncherLink, \
    fork_coordinator, stop_process
from recover_patches.collectives.leader_agent import LeaderAgent
from recover_patches.collectives.node_beats import NodeBeatRelay
from recover_patches.collectives.protocol import current_address
from recover_patches.collectives.self_fence import SelfFence

logger = logging.getLogger(__name__)

FIRST_LEADER_WITHIN = 30.0  # seconds a launcher waits for etcd to name a leader at start


class ElectedCoordinator(CoordinatorHandle):
    def __init__(self, args: Namespace, token: str, ttl: int):
        host = args.local_addr or socket.getfqdn()
        port = args.coordinator_port or _free_port(host)
        super().__init__(host, port, token, args.node_rank, args.nnodes, None,
                         args.nnodes * args.nproc_per_node)
        self._dir = Path(tempfile.mkdtemp(prefix="recover-leader-"))
        self.address_file = self._dir / "coordinator"
        self._wanted: tuple[str, bool] | None = None  # the agent's last request: start or stop
        self._lock = threading.Lock()
        self._election_args = (parse_endpoints(args.rdzv_endpoint), args.rdzv_id, ttl)
        self._etcd = EtcdCluster(self._election_args[0])  # the agent's: when etcd last answered
        election = Election(self._etcd, args.rdzv_id, ttl)
        name = f"standby{args.node_rank}" if args.standby else f"node{args.node_rank}"
        self.agent = LeaderAgent(election, name, f"{host}:{port}", self.address_file,
                                 self._want_start, self._want_stop, candidate=not args.standby)
        self._job = args.rdzv_id
        self._first_round(ttl)

    def _first_round(self, ttl: int) -> None:
        """Campaign until etcd names a leader (this node or another), then start the agent's
        loop; without a leader within FIRST_LEADER_WITHIN, CoordinatorConfigError."""
        deadline = time.monotonic() + FIRST_LEADER_WITHIN
        while True:
            self.agent.step()  # (an unreachable etcd is the step's to wait out)
            if self.address_file.exists():
                break
            if time.monotonic() > deadline:
                raise CoordinatorConfigError(
                    f"--rdzv-endpoint: no etcd leader for job {self._job!r} within "
                    f"{FIRST_LEADER_WITHIN:g}s; check that the etcd members answer")
            time.sleep(min(1.0, ttl / 3))
        self._act()
        self.agent.start()

    def _want_start(self, successor: bool) -> None:
        with self._lock:
            self._wanted = ("start", successor)

    def _want_stop(self) -> None:
        with self._lock:
            self._wanted = ("stop", False)

    def _act(self) -> None:
        with self._lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        action, successor = wanted
        if action == "start" and self.pid is None:
            self._fork(successor)
        elif action == "stop" and self.pid is not None:
            stop_process(self.pid, grace=1.0)  # fenced: another node may lead already
            self.pid = None

    def _fork(self, successor: bool) -> None:
        leadership = self.agent.leading
        if leadership is None:  # deposed meanwhile
            return
        endpoints, job, ttl = self._election_args
        first = self._etcd.current_index  # a member known to answer (a dead one costs seconds)
        self.pid, _ = fork_coordinator(
            self.port, self.token, self.world_size, restarted=successor,
            journal=lambda: ElectionJournal(Election(EtcdCluster(endpoints, first=first), job,
                                                     ttl), leadership))

    def restart_if_dead(self) -> None:
        """The agent's requests; then, while this node leads, a successor for a coordinator that
        died (one that was fenced exits too, and its node's agent is deposed at its next step)."""
        self._act()
        if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] != 0:
            logger.warning(f"the coordinator (pid {self.pid}) exited: a successor if this node "
                           "still leads")
            self.pid = None
            self._fork(successor=True)
            self.restarts += 1

    def self_fence(self, link: LauncherLink | None, limit: float,
                   fence: Callable[[str], None]) -> SelfFence:
        """Fence this node's ranks once neither etcd's majority nor another node's coordinator
        has answered for `limit` seconds (`self_fence.py`): answers of this node's own
        coordinator, even from before it stopped leading, prove nothing."""
        def silent_for() -> float:
            heard = self._etcd.answered_at
            if link is not None and link.connected_to != (self.host, self.port):  # another's
                heard = max(heard, link.answered_at)
            return time.monotonic() - heard
        return SelfFence(silent_for, limit, fence)

    def env(self) -> dict[str, str]:
        return {"RECOVER_COORDINATOR": self.current(), "RECOVER_JOB_TOKEN": self.token,
                "RECOVER_COORDINATOR_FILE": str(self.address_file)}

    def current(self) -> str:
        host, port = current_address(self.address_file, self.host, self.port)
        return f"{host}:{port}"

    def connect(self, relay: NodeBeatRelay | None = None) -> LauncherLink:
        # (the link reads the file itself on every connect)
        return LauncherLink(self.host, self.port, self.token, self.node_rank, self.address_file,
                            relay)

    def finish(self, link: LauncherLink | None, should_stop=lambda: False
               ) -> tuple[int, frozenset[int]] | None:
        """As node 0's handle, if this node leads now; then hand the leadership over."""
        self._act()
        try:
            return super().finish(link, should_stop)
        finally:
            self.agent.close()
            shutil.rmtree(self._dir, ignore_errors=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
