"""The launcher's election loop: one node leads and runs the coordinator, the others follow and
know its address; a leader whose lease lapsed stops its coordinator before anyone else could
decide beside it; a successor starts as one (the ranks bring their state); a clean exit hands
over at once. In memory, then against a real etcd member."""
from __future__ import annotations

import time

import pytest

from recover_patches.collectives.election import Election, Leadership
from recover_patches.collectives.etcd_cluster import ClusterUnreachable, EtcdCluster
from recover_patches.collectives.leader_agent import LeaderAgent
from recover_patches.collectives.protocol import read_address
from tests.collectives.etcd_members import EtcdMembers, needs_etcd

pytestmark = pytest.mark.timeout(60)


class MemoryElection:
    """etcd's leader key, lease and records as the agent sees them."""
    ttl = 1

    def __init__(self):
        self.current: Leadership | None = None
        self.revision = 0
        self.records: dict[str, dict] = {}
        self.reachable = True

    def _check(self) -> None:
        if not self.reachable:
            raise ClusterUnreachable("no etcd member answered")

    def campaign(self, node, address):
        self._check()
        if self.current is not None:
            return None
        self.revision += 1
        self.current = Leadership(node, address, self.revision, self.revision)
        return self.current

    def keep(self, leadership):
        self._check()
        return self.current == leadership

    def resign(self, leadership):
        if self.current == leadership:
            self.current = None

    def leader(self):
        self._check()
        return self.current

    def write(self, leadership, name, record):
        ok = self.current == leadership
        if ok:
            self.records[name] = record
        return ok

    def read(self, name):
        return self.records.get(name)


def agent(election, node: str, tmp_path, events: list) -> LeaderAgent:
    return LeaderAgent(election, node, f"{node}:29400", tmp_path / f"{node}.address",
                       start_coordinator=lambda successor: events.append((node, "start", successor)),
                       stop_coordinator=lambda: events.append((node, "stop")))


def test_one_node_leads_the_rest_follow_and_a_lapsed_leader_stops_before_its_successor(tmp_path):
    election, events = MemoryElection(), []
    a, b = agent(election, "a", tmp_path, events), agent(election, "b", tmp_path, events)
    a.step()
    b.step()
    assert events == [("a", "start", False)]  # the job's first coordinator
    assert read_address(b.address_file, "none") == "a:29400" == read_address(a.address_file, "")
    election.current = None  # a's lease lapsed (its node paused or cut off)
    b.step()
    assert events[-1] == ("b", "start", True)  # a successor: the ranks bring their state
    a.step()  # a learns it from its renewal: it stops deciding, then follows b
    assert events[-1] == ("a", "stop") and a.leading is None
    assert read_address(a.address_file, "") == "b:29400"
    b.close()
    assert election.current is None  # a clean exit does not make the others wait a TTL


def test_a_leader_that_cannot_reach_etcd_leads_on_until_its_lease_may_have_lapsed(tmp_path):
    """An etcd member's death (a Raft election) must not stop the job's coordinator; but once a
    TTL passed since its last confirmed renewal, another node may lead: it stops."""
    election, events, now = MemoryElection(), [], [0.0]
    a = LeaderAgent(election, "a", "a:29400", tmp_path / "a.address",
                    start_coordinator=lambda successor: events.append(("a", "start", successor)),
                    stop_coordinator=lambda: events.append(("a", "stop")), clock=lambda: now[0])
    a.step()
    election.reachable = False
    now[0] = 0.9 * election.ttl
    a.step()
    assert events == [("a", "start", False)] and a.leading is not None
    now[0] = 1.0 * election.ttl
    a.step()
    assert events == [("a", "start", False), ("a", "stop")] and a.leading is None
    follower = agent(election, "b", tmp_path, events)
    follower.step()  # a follower that cannot reach etcd just waits
    assert events[-1] == ("a", "stop")


@needs_etcd
def test_a_dead_leaders_node_is_replaced_within_its_lease(tmp_path):
    members = EtcdMembers(tmp_path, 1)
    try:
        events: list = []
        elect = lambda: Election(EtcdCluster(members.endpoints), "agents", ttl=1)  # noqa: E731
        a, b = agent(elect(), "a", tmp_path, events), agent(elect(), "b", tmp_path, events)
        a.step()
        b.step()
        start = time.monotonic()  # a's node dies: it takes no more steps
        while b.leading is None and time.monotonic() - start < 10:
            time.sleep(b.election.ttl / 3)
            b.step()
        assert b.leading is not None and time.monotonic() - start < 3  # TTL + a step or two
        assert events == [("a", "start", False), ("b", "start", True)]
        assert read_address(b.address_file, "") == "b:29400"
    finally:
        members.stop()
