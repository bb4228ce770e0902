"""Real etcd members on this host (Debian's etcd-server), each on its own ports and data dir,
killed by PID when the test ends. Tests that need them skip, with the reason, without `etcd`."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(ETCD is None, reason="needs the etcd binary (Debian: etcd-server)")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class EtcdMembers:
    """`size` members of one cluster on 127.0.0.1; `client_ports[i]` is member i's client port."""

    def __init__(self, root: Path, size: int):
        ports = _free_ports(2 * size)
        self.client_ports, peer_ports = ports[:size], ports[size:]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peer_ports))
        self.procs: list[subprocess.Popen] = []
        for i in range(size):
            client = f"http://127.0.0.1:{self.client_ports[i]}"
            log = open(root / f"etcd{i}.log", "w")  # noqa: SIM115 -- the member's whole life
            self.procs.append(subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self._wait_healthy(20.0)

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    def _wait_healthy(self, timeout: float) -> None:
        import requests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(requests.get(f"http://127.0.0.1:{p}/health", timeout=1).json()
                       .get("health") == "true" for p in self.client_ports):
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd members not healthy within {timeout:g}s")

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
