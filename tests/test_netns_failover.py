"""Hosts with their own addresses: one network namespace per node (`scripts/hosts.py`), an
etcd member and a launcher in each of three (`--rdzv-backend etcd`, one rank per node, DP 3), and
a standby node in a fourth (`--standby`: it follows the election, it does not run for it).
Node 0, which leads, is lost whole at iteration 3: its launcher, coordinator and rank by the
`node` fault, then its etcd member with everything else left in its namespace. Nodes 1 and 2
elect a successor over the two etcd members left (a majority); the standby process, which was
waiting on node 0's coordinator, follows the election to the successor, is given rank 0 and
re-forms replica 0. Every iteration commits its M microbatches with the failure-free losses; no
other rank is declared dead.

(A slow, lossy link: `tests/test_netns_lossy_link.py`.)"""
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
from tests.test_failover import assert_failure_free, trained

ITERS, M = 16, 8  # iterations of about 2 s from the 4th on: the standby joins before the end
COMMON = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even"]
SLOW = ("--inject-fault", "slow:rank=1,seconds=0.6,iter=4,phase=forward")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400), needs_etcd, needs_netns]


def start_node(hosts: Hosts, node: int, endpoints: str, job: str, token: str, metrics, *extra,
               flags: tuple[str, ...] = tuple(COMMON), output=(subprocess.PIPE, subprocess.PIPE),
               standby: bool = False):
    """`output`: where the launcher's stdout and stderr go (pipes, or files a test reads).
    `standby`: a standby node in namespace `node` (standby index 0)."""
    where = ["--node-rank", "0", "--standby"] if standby else ["--node-rank", str(node)]
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "1",
           "--nnodes", "3", *where, "--master-addr", hosts.address(0),
           "--master-port", "29555", "--job-token", token, "--rdzv-backend", "etcd",
           "--rdzv-endpoint", endpoints, "--rdzv-id", job, "--local-addr", hosts.address(node),
           str(REPO / "pretrain_gpt_recover.py"), *flags, "--metrics-file", str(metrics), *extra]
    return hosts.popen(node, cmd, cwd=REPO, env=base_env(), stdout=output[0], stderr=output[1],
                       text=True, start_new_session=True)


def test_a_lost_leading_node_is_re_formed_by_a_standby_node_on_the_failure_free_losses(tmp_path):
    reference = launch(1, COMMON, tmp_path / "reference.jsonl", timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job, token, metrics = f"netns-{secrets.token_hex(4)}", secrets.token_hex(8), \
        tmp_path / "metrics.jsonl"
    hosts = Hosts(4)
    procs: dict[int, subprocess.Popen] = {}
    members = None
    try:
        members = EtcdMembers(tmp_path, 3, [hosts.address(i) for i in range(3)], hosts.popen)
        endpoints = members.rdzv_endpoint
        procs[0] = start_node(hosts, 0, endpoints, job, token, metrics,
                              "--inject-fault", "node:rank=0,iter=3,phase=forward")
        election = Election(EtcdCluster(members.endpoints), job, 5)
        deadline = time.monotonic() + 90
        while (leader := election.leader()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leader is not None and leader.node == "node0"  # so the node lost is the leader
        procs[1] = start_node(hosts, 1, endpoints, job, token, metrics, *SLOW)
        procs[2] = start_node(hosts, 2, endpoints, job, token, metrics)
        procs[3] = start_node(hosts, 3, endpoints, job, token, metrics, standby=True)
        procs[0].wait(timeout=240)  # the `node` fault: launcher, coordinator and rank 0
        hosts.kill_host(0)  # and the rest of node 0: its etcd member
        out = {n: procs[n].communicate(timeout=240) for n in (1, 2, 3)}
    finally:
        hosts.close()  # every process in the namespaces, by PID
        for proc in procs.values():
            proc.wait()
        if members is not None:
            members.stop()  # (reaped)
    stderr = out[1][1] + out[2][1] + out[3][1]
    failed = [n for n in (1, 2, 3) if procs[n].returncode != 0]
    assert not failed, "\n".join(f"node {n} exited {procs[n].returncode}; its stdout:\n"
                                  f"{out[n][0][-3000:]}\nits stderr:\n{out[n][1][-4000:]}"
                                  for n in failed)
    assert re.search(r"node node[12] leads .*a successor coordinator", stderr), stderr[-4000:]
    assert "standby 0.0 takes rank 0" in stderr, stderr[-4000:]  # given by the successor
    records = trained(metrics)
    assert_failure_free(records, reference.losses(), ITERS, M, stderr)
    live = [r["live_replicas"] for r in records]
    assert [1, 2] in live and live[-1] == [0, 1, 2], live  # lost, then re-formed
    declared = {int(r) for dead in re.findall(r"dead ranks \[([\d, ]*)\]", stderr)
                for r in dead.split(",") if r.strip()}
    assert declared == {0}, stderr[-4000:]
