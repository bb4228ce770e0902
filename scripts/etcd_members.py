"""Real etcd members on this host (Debian's etcd-server), each on its own ports and data dir,
killed by process group when their user ends them (`stop`). `leader()` names the member that
leads, `kill(i)` loses one and `restart(i)` brings it back on its data directory, as an operator
restarting the service would. Callers check `ETCD` (None: no etcd binary here)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ETCD = shutil.which("etcd")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class EtcdMembers:
    """`size` members of one cluster; `client_ports[i]` is member i's client port. By default all
    on 127.0.0.1 (free ports); with `hosts` (one address each, e.g. network namespaces of
    `scripts/hosts.py`) etcd's own ports, each member started by `spawn(i, command, **popen)`."""

    def __init__(self, root: Path, size: int, hosts: list[str] | None = None, spawn=None):
        if hosts is None:
            ports = _free_ports(2 * size)
            self.client_ports, peer_ports = ports[:size], ports[size:]
            self.hosts = ["127.0.0.1"] * size
        else:
            self.client_ports, peer_ports, self.hosts = [2379] * size, [2380] * size, hosts
        self._spawn = spawn or (lambda _i, cmd, **kw: subprocess.Popen(cmd, **kw))
        self.root = root
        cluster = ",".join(f"m{i}=http://{h}:{p}" for i, (h, p) in
                           enumerate(zip(self.hosts, peer_ports)))
        self.commands: list[list[str]] = []
        self.procs: list[subprocess.Popen] = []
        for i in range(size):
            client, peer = (f"http://{self.hosts[i]}:{self.client_ports[i]}",
                            f"http://{self.hosts[i]}:{peer_ports[i]}")
            self.commands.append([
                ETCD or "etcd", "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--heartbeat-interval", "50", "--election-timeout", "500"])
            self.procs.append(self._start(i))
        self._wait_healthy(20.0)

    def _start(self, i: int) -> subprocess.Popen:
        log = open(self.root / f"etcd{i}.log", "a")  # noqa: SIM115 -- the member's whole life
        return self._spawn(i, self.commands[i], stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)

    def restart(self, index: int) -> None:
        """Member `index` again, on its data directory (it rejoins the cluster it was in)."""
        if self.procs[index].poll() is not None:
            self.procs[index] = self._start(index)

    def leader(self) -> int | None:
        """The index of the member that leads now (None: no live member knows one)."""
        import requests
        ids: dict[int, int] = {}
        leader = None
        for i, (host, port) in enumerate(self.endpoints):
            if self.procs[i].poll() is not None:
                continue
            try:
                status = requests.post(f"http://{host}:{port}/v3/maintenance/status", json={},
                                       timeout=1).json()
            except (requests.RequestException, ValueError):
                continue
            ids[int(status["header"]["member_id"])] = i
            leader = int(status.get("leader", 0)) or leader
        return ids.get(leader) if leader is not None else None

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return list(zip(self.hosts, self.client_ports))

    @property
    def rdzv_endpoint(self) -> str:
        """The members as `--rdzv-endpoint` takes them."""
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def _wait_healthy(self, timeout: float) -> None:
        if not self.healthy_within(timeout):
            self.stop()
            raise RuntimeError(f"etcd members not healthy within {timeout:g}s")

    def healthy_within(self, timeout: float) -> bool:
        """Whether every member says it is healthy within `timeout` seconds."""
        import requests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(requests.get(f"http://{h}:{p}/health", timeout=1).json()
                       .get("health") == "true" for h, p in self.endpoints):
                    return True
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)
        return False

    def kill(self, index: int) -> None:
        os.killpg(self.procs[index].pid, signal.SIGKILL)
        self.procs[index].wait()

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
