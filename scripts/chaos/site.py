"""What the harness keeps on this machine for the whole job, across its launches: the network
namespaces nodes run in (where they can be made) and the etcd members of an elected
coordinator's rendezvous (with --etcd).

Node i of every launch runs in namespace i (its leftovers are killed and its link mended before
the next launch reuses it); each standby launcher gets a namespace of its own; the etcd members
have theirs too, so a node lost or cut takes no member with it. Without namespaces every process
shares this machine's loopback and nothing can be cut.
"""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from scripts.etcd_members import EtcdMembers
from scripts.hosts import Hosts

ETCD_MEMBERS = 3
ETCD_BACK_AFTER = 2.0  # seconds before a killed etcd member is restarted (an operator's restart)
ETCD_HEALTHY_WITHIN = 20.0  # seconds the next leader's kill waits for every member to be back
LEASE_TTL = 2  # the elected coordinator's lease (s): a successor within about 1.4 x this


class Site:
    def __init__(self, nodes: int, netns: bool, etcd: bool, directory: Path):
        self.nodes = nodes
        self.hosts = Hosts(nodes) if netns else None
        self.etcd: EtcdMembers | None = None
        self._timers: list[threading.Timer] = []
        if etcd:
            directory.mkdir(parents=True, exist_ok=True)
            if self.hosts is None:
                self.etcd = EtcdMembers(directory, ETCD_MEMBERS)
            else:
                spots = [self.hosts.add() for _ in range(ETCD_MEMBERS)]
                hosts = self.hosts
                self.etcd = EtcdMembers(directory, ETCD_MEMBERS,
                                        [hosts.address(i) for i in spots],
                                        lambda i, cmd, **kw: hosts.popen(spots[i], cmd, **kw))

    # --- where launchers run ----------------------------------------------------------------
    def host_for(self, launcher: int) -> int | None:
        """The namespace of the launch's `launcher`-th launcher (nodes first, then standbys)."""
        if self.hosts is None:
            return None
        if launcher < self.nodes:
            self.hosts.kill_host(launcher)  # (what an earlier launch left there)
            self.hosts.mend(launcher)
            return launcher
        return self.hosts.add()

    def address(self, host: int | None) -> str:
        return "127.0.0.1" if self.hosts is None or host is None else self.hosts.address(host)

    def popen(self, host: int | None, cmd: list[str], **kwargs) -> subprocess.Popen:
        if self.hosts is None or host is None:
            return subprocess.Popen(cmd, **kwargs)
        return self.hosts.popen(host, cmd, **kwargs)

    def rendezvous(self, host: int | None, job: str) -> list[str]:
        """The launcher flags of an elected coordinator's rendezvous (none without --etcd)."""
        if self.etcd is None:
            return []
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.rdzv_endpoint,
                "--rdzv-id", job, "--rdzv-conf", f"lease_ttl={LEASE_TTL}",
                "--local-addr", self.address(host)]

    # --- faults the harness makes -----------------------------------------------------------
    def cut(self, host: int | None) -> bool:
        """Take the namespace's link down (never node 0's); whether it was."""
        if self.hosts is None or host in (None, 0):
            return False
        self.hosts.cut(host)
        return True

    def kill_etcd_leader(self) -> int | None:
        """SIGKILL the member that leads (restarted ETCD_BACK_AFTER later); its index. Only
        once every member is back from the last kill: two members down of three is etcd's
        majority lost, an outage the job is not meant to outlive (its ranks fence themselves)."""
        if self.etcd is None:
            return None
        for timer in self._timers:  # the last one restarted, and every member healthy again
            timer.join()
        if not self.etcd.healthy_within(ETCD_HEALTHY_WITHIN) or \
                (leader := self.etcd.leader()) is None:
            return None
        self.etcd.kill(leader)
        timer = threading.Timer(ETCD_BACK_AFTER, self.etcd.restart, args=(leader,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return leader

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        if self.etcd is not None:
            self.etcd.stop()
        if self.hosts is not None:
            self.hosts.close()
