"""A slow, lossy link: three hosts with their own addresses (`scripts/hosts.py`), an etcd
member and a launcher with one rank on each (DP 3, `--rdzv-backend etcd`, the default
`--recover-timeout`). Node 2's link delays every frame it sends by 200 ms and drops 5 % of them,
as `tc netem` on its eth0 would (`scripts/lossy_link.py`: this kernel has no netem qdisc). Node 0
leads, so node 2's heartbeats, votes and gradients all cross the bad link.

Nobody is declared dead (no false verdict), every iteration commits its M microbatches with the
failure-free losses, and every launcher exits 0."""
from __future__ import annotations

import contextlib
import secrets
import subprocess
import time

import pytest

from recover_patches.collectives.election import Election
from recover_patches.collectives.etcd_cluster import EtcdCluster
from tests._launch_util import TINY_GPT, launch
from tests.collectives.etcd_members import EtcdMembers, needs_etcd
from tests.netns import Hosts, needs_netns
from tests.test_failover import assert_failure_free, trained, wait_until
from tests.test_netns_failover import start_node

DELAY, LOSS = 0.2, 0.05
ITERS, M = 4, 8  # an iteration takes about 3 s over the bad link
FLAGS = (*TINY_GPT, "--train-iters", str(ITERS), "--recover-balance", "even")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420), needs_etcd, needs_netns]


def files(tmp_path, node: int, opened: list):
    """The launcher's output into files: pipes nobody reads while it runs would fill and block."""
    opened += [open(tmp_path / f"out{node}", "w"), open(tmp_path / f"err{node}", "w")]
    return opened[-2:]


def test_a_slow_lossy_link_brings_no_false_verdict(tmp_path):
    reference = launch(1, list(FLAGS), tmp_path / "reference.jsonl", timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job, token, metrics = f"lossy-{secrets.token_hex(4)}", secrets.token_hex(8), \
        tmp_path / "metrics.jsonl"
    hosts = Hosts(3, lossy={2: (DELAY, LOSS)})
    procs: dict[int, subprocess.Popen] = {}
    opened: list = []
    members = None
    try:
        members = EtcdMembers(tmp_path, 3, [hosts.address(i) for i in range(3)], hosts.popen)
        endpoints = members.rdzv_endpoint
        procs[0] = start_node(hosts, 0, endpoints, job, token, metrics, flags=FLAGS,
                              output=files(tmp_path, 0, opened))
        election = Election(EtcdCluster(members.endpoints), job, 5)
        assert wait_until(election.leader, "an election", 90).node == "node0"
        procs.update({n: start_node(hosts, n, endpoints, job, token, metrics, flags=FLAGS,
                                    output=files(tmp_path, n, opened)) for n in (1, 2)})
        deadline = time.monotonic() + 300
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        frames = hosts.relay_counts(2)
    finally:
        hosts.close()  # every process in the namespaces and the relay, by PID
        for proc in procs.values():
            proc.wait()
        for file in opened:
            file.close()
        if members is not None:
            members.stop()
    logs = "".join(f"--- node {n}\n" + (tmp_path / f"out{n}").read_text()
                   + (tmp_path / f"err{n}").read_text() for n in procs)
    assert [procs[n].returncode for n in range(3)] == [0, 0, 0], logs[-8000:]
    assert "dead ranks" not in logs and "fencing" not in logs, logs[-8000:]  # whole logs
    records = trained(metrics)
    assert_failure_free(records, reference.losses(), ITERS, M, logs)
    assert all(r["recoveries"] == [] and r["live_replicas"] == [0, 1, 2] for r in records)
    sent = frames["relayed"] + frames["dropped"]  # the link was used, and lost what it should
    assert sent > 1000 and 0.5 * LOSS < frames["dropped"] / sent < 2 * LOSS, frames
