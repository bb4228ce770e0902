"""Hosts with real addresses on this machine: one network namespace per "node", each joined
to a bridge by a veth pair (iproute2), so every node has its own address (10.R.0.i) and its own
link (the bridge holds 10.R.0.254 for the caller itself). Processes run inside a namespace with
`ip netns exec`; `kill_host` kills every process of one namespace (launcher, coordinator, ranks,
etcd member: a node lost whole); `cut` takes a node's link down (a partition); `add` makes one
more node (a spare node the chaos harness starts a standby launcher on). Root only: callers
check `available()`.

A node in `lossy` gets a slow, lossy link instead of a veth pair: `scripts/lossy_link.py` relays
its frames between two TAP devices in user space, delaying and dropping them as netem would
(this kernel once had no netem qdisc).

Cleanup kills every process still in the namespaces (by PID, from `ip netns pids`) and the
relays (by PID), then deletes the namespaces and the bridge."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path



def available() -> bool:
    """Network namespaces can be made here: root, with iproute2."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, count: int, lossy: dict[int, tuple[float, float]] | None = None):
        """`lossy`: {node: (delay in seconds, loss probability)} on what the node sends."""
        lossy = lossy or {}
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{int(self.tag, 16) % 200 + 20}.0"
        self.bridge = f"rcvbr{self.tag}"
        self.names: list[str] = []
        self.links: list[str] = []  # each node's end on the bridge
        self.relays: dict[int, subprocess.Popen] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)  # the caller's own
            _ip("link", "set", self.bridge, "up")
            for i in range(count):
                self.add(lossy.get(i))
        except BaseException:  # a failed `ip` or relay: nothing is left behind
            self.close()
            raise

    def add(self, lossy: tuple[float, float] | None = None) -> int:
        """One more node (up to 253 in all); its index."""
        i = len(self.names)
        name, link = f"rcv{self.tag}n{i}", f"rcv{self.tag}v{i}"
        self.names.append(name)
        self.links.append(link)
        _ip("netns", "add", name)
        if lossy is not None:
            self._relay(i, *lossy, node_end=f"rcv{self.tag}t{i}")
        else:
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", link, "master", self.bridge)
        _ip("link", "set", link, "up")
        _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        return i

    def _relay(self, i: int, delay: float, loss: float, node_end: str) -> None:
        script = str(Path(__file__).with_name("lossy_link.py"))
        relay = subprocess.Popen([sys.executable, script, node_end, self.links[i], str(delay),
                                  str(loss), str(i)], stdout=subprocess.PIPE, text=True)
        self.relays[i] = relay
        if relay.stdout is None or relay.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the lossy link relay for node {i} did not start")
        _ip("link", "set", node_end, "netns", self.names[i])
        _ip("-n", self.names[i], "link", "set", node_end, "name", "eth0")

    def relay_counts(self, i: int) -> dict[str, int]:
        """Stops node i's relay; {"relayed": frames, "dropped": frames}."""
        relay = self.relays.pop(i)
        relay.terminate()
        out, _ = relay.communicate(timeout=10)
        words = out.split()
        return {words[k]: int(words[k + 1]) for k in (0, 2)}

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def popen(self, i: int, cmd: list[str], hosts_file: Path | None = None,
              **kwargs) -> subprocess.Popen:
        """`cmd` inside node i (gloo uses its eth0: the hostname would resolve to loopback).
        `hosts_file`: node i also gets a host name of its own, its namespace's name (a UTS
        namespace), and this file as /etc/hosts (a mount namespace: names resolving to the
        nodes' addresses); the rest of the file system is the host's (`ip netns exec` would mount
        a new /sys, without the cgroups slurmd needs)."""
        env = {**kwargs.pop("env", os.environ), "GLOO_SOCKET_IFNAME": "eth0"}
        enter = ["ip", "netns", "exec", self.names[i]]
        if hosts_file is not None:
            enter = ["nsenter", f"--net=/run/netns/{self.names[i]}", "--", "unshare", "--mount",
                     "--uts", "--propagation", "private", "--", "sh", "-c",
                     'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"',
                     self.names[i], str(hosts_file)]
        return subprocess.Popen([*enter, *cmd], env=env, **kwargs)

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> None:
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, i: int) -> None:
        """Node i's link down (its bridge-side end): nothing passes either way, and nothing is
        closed: its connections hang, as over a failed switch port."""
        _ip("link", "set", self.links[i], "down")

    def mend(self, i: int) -> None:
        """Node i's link up again (after `cut`)."""
        _ip("link", "set", self.links[i], "up")

    def close(self) -> None:
        for relay in self.relays.values():
            relay.kill()
            relay.wait()
        for i, name in enumerate(self.names):
            self.kill_host(i)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
