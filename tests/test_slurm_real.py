"""The sbatch template on a real SLURM (Debian's slurm-wlm with munge), brought up for this module
in a temporary directory and torn down by PID: three SLURM nodes, each a network namespace of
`scripts/hosts.py` with its own address and its own slurmd, so a job's launchers, ranks and
etcd members talk over real addresses, a job can lose a node and a standby node can take over.

Needs root on Debian: installs slurm-wlm with apt when it is missing (once per machine), and skips
with the reason where it cannot. Several *machines* are not tested: the nodes share one kernel and
one file system.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.training.checkpointing import read_latest
from tests.collectives.etcd_members import EtcdMembers, needs_etcd
from tests.netns import Hosts, needs_netns

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess, pytest.mark.timeout(420), needs_netns]

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")


def _install() -> str | None:
    """None when SLURM is there (installed now if need be), else why it cannot be."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return None
    if os.geteuid() != 0:
        return "SLURM is not installed and installing it needs root"
    if not Path("/etc/debian_version").exists() or not shutil.which("apt-get"):
        return "SLURM is not installed and this is not a Debian machine with apt"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    for attempt in (install, ["apt-get", "update", "-q"], install):
        done = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=600)
        if attempt is install and done.returncode == 0:
            return None
    return f"apt-get could not install slurm-wlm: {done.stderr.strip()[-300:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(path: str) -> str:
    return shutil.which(path) or f"/usr/sbin/{path}"


class Cluster:
    """munged and slurmctld on this host, one slurmd in each network namespace of `hosts`, all in
    the foreground, as children of this process. A node's SLURM name is its host name (its
    namespace's), and every node resolves every node's name to that node's address."""

    def __init__(self, root: Path, hosts: Hosts) -> None:
        self.root, self.hosts, self.procs = root, hosts, []
        host, controller = socket.gethostname(), f"{hosts.subnet}.254"  # the bridge's address
        self.nodes = list(hosts.names)
        (root / "state").mkdir()
        for i, node in enumerate(self.nodes):
            (root / "spool" / node).mkdir(parents=True)
            (root / f"hosts.{node}").write_text("127.0.0.1 localhost\n" + "".join(
                f"{hosts.address(j)} {name}\n" for j, name in enumerate(self.nodes)))
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=recover", f"SlurmctldHost={host}({controller})", "SlurmUser=root",
            "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge.sock",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.%n.pid",
            f"SlurmctldPort={_free_port()}",
            f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.%n.log",
            "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none",
            "ReturnToService=2", "MinJobAge=600",
            *(f"NodeName={node} NodeHostname={node} NodeAddr={hosts.address(i)} Port=6818 "
              f"CPUs={os.cpu_count()} State=UNKNOWN" for i, node in enumerate(self.nodes)),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            self._bring_up()
        except BaseException:  # nothing is left running
            self.stop()
            raise

    def _bring_up(self) -> None:
        root = self.root
        self._start([_daemon("munged"), "-F", "--force", f"--socket={root}/munge.sock",
                     f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                     f"--seed-file={root}/munged.seed"])
        self._wait_for(lambda: (root / "munge.sock").exists(), "munged's socket")
        self._start([_daemon("slurmctld"), "-D", "-f", str(self.conf)])
        for i, node in enumerate(self.nodes):
            self._start([_daemon("slurmd"), "-D", "-N", node, "-f", str(self.conf)], i)
        self._wait_for(lambda: self.run("sinfo", "-h", "-o", "%T %D").split() == ["idle", "3"],
                       "three idle nodes")

    def _start(self, cmd: list[str], node: int | None = None) -> None:
        """`cmd` on this host, or inside node `node`'s namespace with its own /etc/hosts."""
        name = "" if node is None else self.nodes[node]
        log = open(self.root / f"{Path(cmd[0]).name}{name}.out", "w")  # noqa: SIM115 -- its life
        popen = functools.partial(subprocess.Popen) if node is None else functools.partial(
            self.hosts.popen, node, hosts_file=self.root / f"hosts.{name}")
        self.procs.append(popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True))

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-800:] for p in self.root.glob("*.out"))
                raise RuntimeError(f"SLURM did not come up ({what}; exited: {dead}):\n{logs}")
            time.sleep(0.2)

    def run(self, *cmd: str) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def stop(self) -> None:
        for proc in reversed(self.procs):  # by PID: each daemon and anything in its session
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _install()
    if why is not None:
        pytest.skip(why)
    hosts = Hosts(3)
    try:
        c = Cluster(tmp_path_factory.mktemp("slurm"), hosts)
        yield c
        c.stop()
    finally:
        hosts.close()  # whatever is left in the namespaces, by PID


def submit(cluster: Cluster, work: Path, nproc: int, *flags: str, nodes: int = 1,
           spare_nodes: int = 0, **settings: str) -> str:
    """sbatch the template with the tiny CPU config (and `settings` in its environment); the job
    id. gloo uses each node's eth0 (its own address; loopback would not reach the others)."""
    env = {**cluster.env, "CONFIG": "tiny_cpu", "CKPT_DIR": str(work / "ck"),
           "NPROC_PER_NODE": str(nproc), "PYTHON": sys.executable, "SPARE_NODES": str(spare_nodes),
           "GLOO_SOCKET_IFNAME": "eth0", **settings}
    done = subprocess.run(["sbatch", "--parsable", "--nodes", str(nodes), "--cpus-per-task",
                           str(os.cpu_count()), "--chdir", str(REPO), "--output",
                           str(work / "out.txt"), str(SBATCH), *flags],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def field(cluster: Cluster, job: str, name: str) -> str:
    for word in cluster.run("scontrol", "show", "job", job).split():
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return ""


def wait(cluster: Cluster, job: str, timeout: float = 300) -> tuple[str, str]:
    """(JobState, ExitCode) once the job has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = field(cluster, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state, field(cluster, job, "ExitCode")
        time.sleep(0.5)
    cluster.run("scancel", "--signal=KILL", job)
    raise AssertionError(f"job {job} still {field(cluster, job, 'JobState')} after {timeout}s")


def leftovers(work: Path) -> list[str]:
    """Processes of this job still alive (they carry its checkpoint path on the command line)."""
    out = subprocess.run(["pgrep", "-af", str(work / "ck")], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def test_a_killed_rank_is_survived_and_the_job_completes(cluster, tmp_path):
    job = submit(cluster, tmp_path, 4, "--train-iters", "10", "--recover-balance", "even",
                 "--inject-fault", "kill:rank=1,iter=5,phase=backward")
    assert wait(cluster, job) == ("COMPLETED", "0:0"), (tmp_path / "out.txt").read_text()[-3000:]
    out = (tmp_path / "out.txt").read_text()
    assert "injecting kill at iter 5" in out
    assert all(f"iteration {i:8d}/" in out for i in range(1, 11))
    assert "but the job declared completion" in out and "success" in out
    assert read_latest(tmp_path / "ck") == 10
    assert leftovers(tmp_path) == []


def test_a_job_whose_last_replica_dies_ends_failed_with_the_restart_status(cluster, tmp_path):
    job = submit(cluster, tmp_path, 2, "--train-iters", "10", "--recover-balance", "even",
                 "--inject-fault", "kill:rank=1,iter=3,phase=backward",
                 "--inject-fault", "kill:rank=0,iter=6,phase=backward")
    state, code = wait(cluster, job)
    out = (tmp_path / "out.txt").read_text()
    # docs/failures.md: the coordinator stopped the job (no replica left) -> 3, for a restart
    assert (state, code) == ("FAILED", "3:0"), out[-3000:]
    assert "injecting kill at iter 3" in out and "injecting kill at iter 6" in out
    assert "the job stopped (no live replica is left" in out
    assert "[recover.slurm] the job stopped: no live replica is left" in out
    assert leftovers(tmp_path) == []


def test_scancel_term_with_exit_signal_handler_saves_and_exits_0(cluster, tmp_path):
    job = submit(cluster, tmp_path, 2, "--train-iters", "100000", "--exit-signal-handler")
    out = tmp_path / "out.txt"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (out.exists() and "iteration        3/" in out.read_text()):
        time.sleep(0.5)
    cluster.run("scancel", "--signal=TERM", job)  # what SLURM sends at the time limit
    assert wait(cluster, job) == ("COMPLETED", "0:0"), out.read_text()[-3000:]
    text = out.read_text()
    assert "SIGTERM (--exit-signal-handler)" in text
    assert (read_latest(tmp_path / "ck") or 0) >= 3
    assert leftovers(tmp_path) == []


@needs_etcd
def test_a_standby_node_takes_over_a_lost_node_and_the_job_completes(cluster, tmp_path):
    """Two training nodes of two ranks and a standby node, an etcd member on each, the
    coordinator elected through etcd (RDZV_ENDPOINT): node 1 dies with its launcher at iteration
    3. srun reports its task killed, yet the job completed: the sbatch script reads the job's
    declared completion and exits 0."""
    hosts = cluster.hosts
    members = EtcdMembers(tmp_path, 3, [hosts.address(i) for i in range(3)], hosts.popen)
    try:
        job = submit(cluster, tmp_path, 2, "--train-iters", "30", "--recover-balance", "even",
                     "--recover-timeout", "3", "--inject-fault", "node:rank=3,iter=3,phase=forward",
                     "--inject-fault", "slow:rank=1,seconds=0.25,iter=4,phase=forward",
                     nodes=3, spare_nodes=1, RDZV_ENDPOINT=members.rdzv_endpoint)
        state = wait(cluster, job)
    finally:
        members.stop()
    out = (tmp_path / "out.txt").read_text()
    assert state == ("COMPLETED", "0:0"), out[-3000:]
    assert "task 1: Killed" in out and "but the job declared complete" in out
    assert re.search(r"node node[01] leads", out), out[-3000:]  # elected, not started on node 0
    assert "takes rank 2" in out and "takes rank 3" in out  # the standby processes re-formed them
    assert all(f"iteration {i:8d}/" in out for i in range(1, 31))
    assert leftovers(tmp_path) == []
