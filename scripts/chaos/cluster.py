"""One launch of the job: N node launchers and S standby launchers on this machine, each in a
session of its own (a node: killing its process group takes its launcher and every rank it
started, as a lost node does), their output in files, the fault lines timed as they arrive.

Where network namespaces can be made (`site.py`: root, iproute2) each launcher runs in one of
its own, with its own address and link, so a node can also be cut off: on a rank's `injecting
cut` line the harness takes that launcher's link down. Its processes stay alive and hear nothing
(they fence themselves); the launch no longer waits for them to end. On an `injecting etcd` line
(with --etcd: the coordinator is elected through etcd) it kills the etcd leader.

A node fault (or a cut) consumes a standby launcher (its processes take the lost node's slots);
whenever a launcher dies by a signal or is cut off, another standby launcher is started, so the
next node fault still finds spares. Everything this module started is ended by process group,
never by name.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.site import Site

REPO = Path(__file__).resolve().parents[2]
INJECTED = re.compile(r"rank (\d+): injecting (\w+) at iter (\d+) phase (\w+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ClusterSettings:
    nodes: int
    per_node: int
    standby: int  # standby launchers kept ready
    script_flags: tuple[str, ...]  # pretrain_gpt_recover.py's, as given after `--`
    env: tuple[tuple[str, str], ...] = ()  # extra environment (the emulated NCCL's switches)
    ledger: str = ""  # RECOVER_FAULT_LEDGER: each fault fires once in the whole run


@dataclass
class Injection:
    """A fault line as it arrived: `rank R: injecting KIND at iter I phase P`."""
    at: float  # the harness's clock
    rank: int
    kind: str
    iteration: int
    phase: str


@dataclass
class Launcher:
    name: str
    proc: subprocess.Popen
    standby: bool
    host: int | None = None  # its network namespace's index
    cut_off: bool = False  # its link was taken down
    readers: list[threading.Thread] = field(default_factory=list)


class Launch:
    def __init__(self, settings: ClusterSettings, specs: list[str], directory: Path, site: Site):
        self.settings, self.directory, self.site = settings, directory, site
        directory.mkdir(parents=True, exist_ok=True)
        self.specs = ";".join(specs)
        self.token = secrets.token_hex(8)
        self.master_port, self.coordinator_port = free_port(), free_port()
        self.launchers: list[Launcher] = []
        self.injections: list[Injection] = []
        self.replaced: set[str] = set()  # launchers a standby launcher was started for
        self._standbys = 0
        self._lock = threading.Lock()

    # --- starting ---------------------------------------------------------------------------
    def start(self) -> None:
        for node in range(self.settings.nodes):
            self._start(f"node{node}", ["--node-rank", str(node)], standby=False)
        for _ in range(self.settings.standby):
            self._start_standby()

    def _start_standby(self) -> None:
        index = self.settings.nodes + self._standbys
        self._standbys += 1
        self._start(f"standby{index}", ["--node-rank", str(index), "--standby"], standby=True)

    def _start(self, name: str, where: list[str], standby: bool) -> None:
        s, site = self.settings, self.site
        host = site.host_for(len(self.launchers))
        rendezvous = site.rendezvous(host, f"chaos-{self.token}") or [
            "--coordinator-port", str(self.coordinator_port)]  # (static: node 0 runs it)
        cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node",
               str(s.per_node), "--nnodes", str(s.nodes), *where, "--master-addr",
               site.address(0), "--master-port", str(self.master_port), *rendezvous,
               "--job-token", self.token, "--max-replacements", "1000", "--failure-window", "0",
               str(REPO / "pretrain_gpt_recover.py"), *s.script_flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RECOVER_INJECT_FAULT=self.specs,
                   RECOVER_FAULT_LEDGER=s.ledger, **dict(s.env))
        streams = dict(cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, start_new_session=True)
        proc = site.popen(host, cmd, **streams)
        launcher = Launcher(name, proc, standby, host)
        for stream, suffix in ((proc.stdout, "out"), (proc.stderr, "err")):
            reader = threading.Thread(target=self._copy, daemon=True,
                                      args=(stream, self.directory / f"{name}.{suffix}", launcher))
            reader.start()
            launcher.readers.append(reader)
        self.launchers.append(launcher)

    def _copy(self, stream, path: Path, launcher: Launcher) -> None:
        """A launcher's output into its file, each fault line timed as it arrives (a cut or an
        etcd leader's kill is made here, while its rank pauses at the phase)."""
        with open(path, "w") as f:
            for line in stream:
                f.write(line)
                if (m := INJECTED.search(line)) is not None:
                    with self._lock:
                        self.injections.append(Injection(time.monotonic(), int(m[1]), m[2],
                                                         int(m[3]), m[4]))
                    if m[2] == "cut":
                        launcher.cut_off = self.site.cut(launcher.host)
                    elif m[2] == "etcd":
                        self.site.kill_etcd_leader()

    # --- watching ---------------------------------------------------------------------------
    def replenish(self) -> None:
        """A launcher killed by a signal lost its node: start a standby launcher in its place."""
        for launcher in list(self.launchers):
            code = launcher.proc.poll()
            lost = launcher.cut_off or (code is not None and code < 0)
            if lost and launcher.name not in self.replaced:
                self.replaced.add(launcher.name)
                if not self.ended():
                    self._start_standby()

    def owner_status(self) -> int | None:
        """The status of node 0's launcher (it runs the coordinator and ends last)."""
        return self.launchers[0].proc.poll()

    def running(self) -> list[str]:
        """The launchers not ended yet, by name and pid."""
        return [f"{launcher.name} (pid {launcher.proc.pid})" for launcher in self.launchers
                if launcher.proc.poll() is None and not launcher.cut_off]

    def ended(self) -> bool:
        """Every launcher ended, but those cut off (they may wait for the coordinator long)."""
        return all(launcher.proc.poll() is not None or launcher.cut_off
                   for launcher in self.launchers)

    def signal_ranks(self, sig: int) -> None:
        """`sig` to every process of every launcher's group but the launchers (SIGUSR2: each
        rank prints its threads' stacks, for a hang)."""
        leaders = {launcher.proc.pid for launcher in self.launchers}
        for pid in _group_members(leaders):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """End whatever is left, by process group; wait for the launchers and their readers."""
        for launcher in self.launchers:
            try:
                os.killpg(launcher.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for launcher in self.launchers:
            launcher.proc.wait()
            for reader in launcher.readers:
                reader.join(10)

    def output(self) -> str:
        return "".join(path.read_text(errors="replace")
                       for path in sorted(self.directory.glob("*.out"))
                       + sorted(self.directory.glob("*.err")))


def _group_members(groups: set[int]) -> list[int]:
    """The processes of these process groups, less the groups' leaders."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pgid = int(stat.read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        if pgid in groups and pid not in groups:
            members.append(pid)
    return members
