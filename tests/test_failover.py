"""Losing the node that runs the coordinator: two "nodes" (one launcher each, one rank each,
DP 2) on this host elect the coordinator through three real etcd members (`--rdzv-backend
etcd`). After iteration 1 the etcd member the nodes talk to first is killed: nothing changes
(no epoch, node 0 still leads). Node 0's whole launcher session (launcher, coordinator, rank 0) is
killed at iteration 3. Node 1's launcher wins the lease after its TTL and starts a successor
coordinator on its own port; rank 1 and node 1's launcher find it through the node's address
file, the successor declares rank 0 dead, and rank 1 finishes every iteration alone, with the
failure-free losses."""
from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from recover_patches.collectives.election import Election
from recover_patches.collectives.etcd_cluster import EtcdCluster
from tests._launch_util import REPO, TINY_GPT, base_env, kill_session, launch, read_metrics
from tests.collectives.etcd_members import EtcdMembers, needs_etcd

ITERS, M = 8, 8
COMMON = [*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even",
          "--recover-timeout", "3"]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300), needs_etcd]


def start_node(node: int, endpoints: str, job: str, token: str, metrics, logs, *faults: str):
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "1", "--nnodes", "2",
           "--node-rank", str(node), "--master-port", "29555", "--job-token", token,
           "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", job,
           "--rdzv-conf", "lease_ttl=2", "--local-addr", "127.0.0.1",
           str(REPO / "pretrain_gpt_recover.py"), *COMMON, "--metrics-file", str(metrics),
           *[a for f in faults for a in ("--inject-fault", f)]]
    return subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=open(logs / f"out{node}", "w"),
                            stderr=open(logs / f"err{node}", "w"), text=True,
                            start_new_session=True)


def wait_until(condition, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout:g}s")


def trained(metrics) -> list[dict]:
    return [r for r in read_metrics(metrics) if "lm_loss" in r] if metrics.exists() else []


def assert_failure_free(records: list[dict], reference: list[float], iters: int, m: int,
                        context: str) -> None:
    """Every iteration committed once, its M microbatches with their ids, the reference losses."""
    assert [r["iteration"] for r in records] == list(range(1, iters + 1)), context[-4000:]
    for mine, ref in zip(records, reference):
        i = mine["iteration"]
        assert mine["microbatches"] == m and mine["id_sum"] == sum(range((i - 1) * m, i * m))
        assert abs(mine["lm_loss"] - ref) <= 1e-5 * abs(ref), (mine, ref)


def test_the_job_survives_an_etcd_member_and_the_node_that_runs_its_coordinator(tmp_path):
    reference = launch(1, COMMON, tmp_path / "reference.jsonl", timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    members = EtcdMembers(tmp_path, 3)
    endpoints = ",".join(f"{host}:{port}" for host, port in members.endpoints)
    job, token, metrics = f"failover-{secrets.token_hex(4)}", secrets.token_hex(8), \
        tmp_path / "metrics.jsonl"
    procs = {}
    try:
        procs[0] = start_node(0, endpoints, job, token, metrics, tmp_path,
                              "node:rank=0,iter=3,phase=forward")
        # node 1 starts once node 0 leads, so the node that is lost is the one leading
        election = Election(EtcdCluster(members.endpoints), job, 2)
        assert wait_until(election.leader, "an election").node == "node0"
        procs[1] = start_node(1, endpoints, job, token, metrics, tmp_path)
        wait_until(lambda: trained(metrics), "iteration 1")
        members.kill(0)  # the member every client tries first
        procs[1].wait(timeout=240)
        procs[0].wait(timeout=10)
    finally:
        for proc in procs.values():
            kill_session(proc.pid)
            proc.wait()
        members.stop()
    out = {n: ((tmp_path / f"out{n}").read_text(), (tmp_path / f"err{n}").read_text())
           for n in procs}
    stderr = out[0][1] + out[1][1]
    assert procs[0].returncode == -signal.SIGKILL  # the lost node's launcher
    assert procs[1].returncode == 0, stderr[-5000:]
    assert "node node1 leads" in out[1][1] and "a successor coordinator" in out[1][1], stderr[-4000:]
    records = trained(metrics)
    assert_failure_free(records, reference.losses(), ITERS, M, stderr)
    assert [r["live_replicas"] for r in records[:2]] == [[0, 1]] * 2  # the etcd member: nothing
    assert records[-1]["live_replicas"] == [1]
    assert re.findall(r"epoch (\d+): dead ranks \[([\d, ]*)\]", stderr) == [("1", "0")], \
        stderr[-4000:]


def test_a_lost_job_ends_everywhere_under_the_elected_coordinator(tmp_path):
    """The lost job of `test_grow_back.py` on two nodes electing their coordinator through etcd
    (node 0: ranks 0 and 1, stage 0; node 1: ranks 2 and 3, stage 1): both launchers and every
    process they started are gone within T + 5 s of the last replica's loss, status 3."""
    from tests._launch_util import run_launchers
    from tests.test_grow_back import assert_the_lost_job_ended, lost_job_script

    members = EtcdMembers(tmp_path, 1)
    endpoints = ",".join(f"{host}:{port}" for host, port in members.endpoints)
    job, token = f"lost-{secrets.token_hex(4)}", secrets.token_hex(8)
    election = Election(EtcdCluster(members.endpoints), job, 2)

    def node(rank: int) -> list[str]:
        return ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(rank),
                "--master-port", "29556", "--job-token", token, "--max-replacements", "2",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", job,
                "--rdzv-conf", "lease_ttl=2", "--local-addr", "127.0.0.1",
                *lost_job_script(tmp_path / "metrics.jsonl")]
    try:  # node 1 starts once node 0 leads: the coordinator runs beside ranks 0 and 1
        run = run_launchers({"node0": node(0), "node1": node(1)}, limit=240, before={
            "node1": lambda: wait_until(election.leader, "an election")})
    finally:
        members.stop()
    assert_the_lost_job_ended(run)
