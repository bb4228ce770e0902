"""The coordinator's leadership and durable record in a real etcd cluster: one leader at a
time, a deposed leader's writes refused (fencing by the leader key's revision), a leader whose
node stops keeping its lease replaced after the TTL, and an etcd member's death unnoticed."""
from __future__ import annotations

import time

import pytest

from recover_patches.collectives.election import Election
from recover_patches.collectives.etcd_cluster import (ClusterUnreachable, EndpointError,
                                                      EtcdCluster, parse_endpoints)
from tests.collectives.etcd_members import EtcdMembers, needs_etcd

pytestmark = pytest.mark.timeout(60)


def test_endpoints_are_torchruns_host_port_list_and_bad_ones_name_the_flag():
    assert parse_endpoints("h1:2379,h2, h3:2380") == [("h1", 2379), ("h2", 2379), ("h3", 2380)]
    for bad in ("h1:x", ":2379", "h1:2379,h1:2379", "h1:70000"):
        with pytest.raises(EndpointError, match="--rdzv-endpoint"):
            parse_endpoints(bad)


@pytest.fixture(scope="module")
def one_member(tmp_path_factory):
    members = EtcdMembers(tmp_path_factory.mktemp("etcd1"), 1)
    yield members
    members.stop()


@needs_etcd
def test_one_leads_and_a_deposed_leader_is_fenced_out(one_member):
    # a dead endpoint first: every call passes over it to the live member
    cluster = EtcdCluster([("127.0.0.1", 9), *one_member.endpoints], timeout=1.0)
    election = Election(cluster, "fence", ttl=1)
    first = election.campaign("n0", "10.0.0.1:29400")
    assert first is not None and election.campaign("n1", "10.0.0.2:29400") is None
    assert election.leader() == first
    assert election.write(first, "epoch", {"epoch": 1})
    deadline = time.monotonic() + 10  # n0 stops keeping its lease: a paused or cut-off leader
    while election.leader() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = election.campaign("n1", "10.0.0.2:29400")
    assert second is not None and second.revision > first.revision
    assert not election.keep(first)  # the old leader learns it lost ...
    assert not election.write(first, "epoch", {"epoch": 99})  # ... and cannot decide meanwhile
    assert election.write(second, "epoch", {"epoch": 2})
    assert election.read("epoch") == {"epoch": 2}
    election.resign(second)
    assert election.leader() is None  # a clean exit hands over at once, not after a TTL


@needs_etcd
def test_a_kept_lease_outlives_its_ttl(one_member):
    election = Election(EtcdCluster(one_member.endpoints), "kept", ttl=1)
    leader = election.campaign("n0", "a:1")
    for _ in range(6):  # 3 s, three TTLs
        assert election.keep(leader)
        time.sleep(0.5)
    assert election.leader() == leader and election.campaign("n1", "b:1") is None


@needs_etcd
@pytest.mark.multiprocess
def test_a_killed_etcd_member_changes_neither_the_leader_nor_the_record(tmp_path):
    members = EtcdMembers(tmp_path, 3)
    try:
        election = Election(EtcdCluster(members.endpoints, timeout=1.0), "ha", ttl=5)
        leader = election.campaign("n0", "a:1")
        assert election.write(leader, "epoch", {"epoch": 3})
        members.kill(0)  # the member every call went to
        # Through another member. Until the survivors have elected a Raft leader they answer
        # nothing (a busy host can take more than one round of the client's timeouts), so keep
        # as the leader agent does: retry while the lease may still run.
        start, kept = time.monotonic(), False
        while not kept and time.monotonic() - start < 5:
            try:
                kept = election.keep(leader)
            except ClusterUnreachable:
                time.sleep(0.1)
        assert kept and time.monotonic() - start < 5  # inside the lease: nobody else led
        assert election.leader() == leader and election.read("epoch") == {"epoch": 3}
        assert election.write(leader, "epoch", {"epoch": 4})
        members.kill(1)  # no majority left: refused, never a stale answer
        with pytest.raises(ClusterUnreachable):
            election.read("epoch")
    finally:
        members.stop()
