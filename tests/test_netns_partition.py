"""A node cut off: four hosts with their own addresses (`scripts/hosts.py`), etcd members on
nodes 0-2, a launcher and one rank on each (DP 4, `--rdzv-backend etcd`). Links are taken down,
not processes killed: the cut side's connections hang instead of closing.

1. After iteration 2, node 3 (it does not lead; no etcd member) is cut. It hears neither etcd's
   majority nor the coordinator: its launcher fences its rank within T + 1 s, and the
   coordinator declares that rank dead.
2. After iteration 4 the leading node 0 is cut, its etcd member with it (two of three keep the
   majority). Its launcher fences its rank within T + 1 s; its coordinator, fenced by its lease,
   publishes nothing. Nodes 1 and 2 elect a successor; their ranks and launchers follow the
   nodes' address files to it (the old connections never close).

Every iteration commits its M microbatches once, with the failure-free losses; each cut rank is
declared dead once and no epoch is published twice with different verdicts (no split brain)."""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
import time

import pytest

from recover_patches.collectives.election import Election
from recover_patches.collectives.etcd_cluster import EtcdCluster
from tests._launch_util import REPO, TINY_GPT, base_env, launch
from tests.collectives.etcd_members import EtcdMembers, needs_etcd
from tests.netns import Hosts, needs_netns
from tests.test_failover import assert_failure_free, trained, wait_until

ITERS, M, T, NODES = 12, 8, 5.0, 4
COMMON = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even",
          "--recover-timeout", str(T)]
# every forward 0.25 s longer (the losses are the same): the second cut lands before the end
SLOWER = [arg for r in range(NODES) for arg in ("--inject-fault", f"slow:rank={r},seconds=0.25")]
FENCED = "fencing this node's ranks"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420), needs_etcd, needs_netns]


def start_node(hosts: Hosts, node: int, endpoints: str, job: str, token: str, tmp_path):
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "1",
           "--nnodes", str(NODES), "--node-rank", str(node), "--master-addr", hosts.address(0),
           "--master-port", "29555", "--job-token", token, "--rdzv-backend", "etcd",
           "--rdzv-endpoint", endpoints, "--rdzv-id", job, "--rdzv-conf", "lease_ttl=2",
           "--local-addr", hosts.address(node), str(REPO / "pretrain_gpt_recover.py"), *COMMON,
           "--metrics-file", str(tmp_path / "metrics.jsonl"), *SLOWER]
    return hosts.popen(node, cmd, cwd=REPO, env=base_env(), stdout=subprocess.DEVNULL,
                       stderr=open(tmp_path / f"err{node}", "w"), start_new_session=True)


def cut_and_time_the_fence(hosts: Hosts, node: int, log) -> float:
    """Cut `node`'s link; seconds until its launcher logs that it fences its rank."""
    hosts.cut(node)
    cut_at = time.monotonic()
    wait_until(lambda: FENCED in log.read_text(), f"node {node} fencing itself", 60)
    return time.monotonic() - cut_at


def test_a_cut_off_node_fences_itself_and_the_rest_keeps_the_losses(tmp_path):
    reference = launch(1, COMMON, tmp_path / "reference.jsonl", timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job, token = f"cut-{secrets.token_hex(4)}", secrets.token_hex(8)
    metrics, logs = tmp_path / "metrics.jsonl", [tmp_path / f"err{n}" for n in range(NODES)]
    hosts = Hosts(NODES)
    procs: dict[int, subprocess.Popen] = {}
    members = None
    try:
        members = EtcdMembers(tmp_path, 3, [hosts.address(i) for i in range(3)], hosts.popen)
        endpoints = members.rdzv_endpoint
        procs[0] = start_node(hosts, 0, endpoints, job, token, tmp_path)
        election = Election(EtcdCluster(members.endpoints), job, 2)
        assert wait_until(election.leader, "an election", 90).node == "node0"
        procs.update({n: start_node(hosts, n, endpoints, job, token, tmp_path)
                      for n in range(1, NODES)})
        wait_until(lambda: len(trained(metrics)) >= 2, "iteration 2", 180)
        first = cut_and_time_the_fence(hosts, 3, logs[3])  # node 0 leads: not this one
        wait_until(lambda: len(trained(metrics)) >= 4, "iteration 4", 180)  # recovered
        second = cut_and_time_the_fence(hosts, 0, logs[0])
        for n in (1, 2):
            procs[n].wait(timeout=180)
        for n in (0, 3):
            procs[n].wait(timeout=60)  # a fenced launcher ends too
    finally:
        hosts.close()  # every process in the namespaces, by PID
        for proc in procs.values():
            proc.wait()
        if members is not None:
            members.stop()
    stderr = "".join(log.read_text() for log in logs)
    assert procs[1].returncode == 0 and procs[2].returncode == 0, stderr[-5000:]
    assert first <= T + 1 and second <= T + 1, (first, second, stderr[-4000:])
    for n in (0, 3):
        assert procs[n].returncode != 0
        assert re.search(rf"rank {n} \(pid \d+\) failed: killed by signal SIGKILL",
                         logs[n].read_text()), logs[n].read_text()[-3000:]
    records = trained(metrics)
    assert_failure_free(records, reference.losses(), ITERS, M, stderr)
    assert records[-1]["live_replicas"] == [1, 2]
    assert re.search(r"node node[12] leads .*a successor coordinator", stderr), stderr[-4000:]
    verdicts = {(int(e), dead) for e, dead in re.findall(r"epoch (\d+): dead ranks \[([\d, ]*)\]",
                                                         stderr)}
    assert len({e for e, _ in verdicts}) == len(verdicts), verdicts  # one verdict per epoch
    assert [dead for _, dead in sorted(verdicts)] == ["3", "0, 3"], verdicts
