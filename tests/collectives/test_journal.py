"""The elected coordinator's journal ([U]): an epoch is journaled before any rank can read it, a
coordinator whose journal refuses (its node lost the lease) publishes nothing and stops, and a
successor starts from the journal's last epoch. In-process coordinators, an in-memory journal
(the fenced write itself is tested against etcd in `test_election.py`)."""
from __future__ import annotations

import json

import pytest

from recover_patches.collectives import protocol as P
from recover_patches.collectives.coordinator import Coordinator, CoordinatorConfig, start_server
from recover_patches.collectives.journal import COMPLETE, EPOCH, Fenced

TOKEN = "journal-test"
pytestmark = pytest.mark.timeout(30)


class MemoryJournal:
    def __init__(self):
        self.records: dict[str, dict] = {}
        self.leading, self.reachable = True, True

    def record(self, name: str, record: dict) -> bool:
        if not self.reachable:
            raise RuntimeError("no etcd member answered")  # as ClusterUnreachable
        if self.leading:
            self.records[name] = json.loads(json.dumps(record))  # as etcd would hand it back
        return self.leading

    def read(self, name: str) -> dict | None:
        return self.records.get(name)


def coordinator_with(journal: MemoryJournal, restarted: bool = False) -> Coordinator:
    return Coordinator(start_server("127.0.0.1", 0),
                       CoordinatorConfig(3, TOKEN, timeout=1.0, restarted=restarted,
                                         journal=journal))


def published_epoch(coordinator: Coordinator) -> int:
    return int(coordinator.store.get(P.EPOCH))


def test_an_epoch_is_journaled_first_and_a_fenced_coordinator_publishes_nothing():
    journal = MemoryJournal()
    coordinator = coordinator_with(journal)
    coordinator.state.mark_dead(2, "test")
    coordinator.tick()
    assert published_epoch(coordinator) == 1
    assert journal.records[EPOCH]["epoch"] == 1 and journal.records[EPOCH]["record"]["dead"] == [2]
    journal.leading = False  # the lease lapsed: another node's coordinator may lead
    coordinator.state.mark_dead(1, "test")
    with pytest.raises(Fenced, match="no longer holds the job's lease"):
        coordinator.tick()
    assert published_epoch(coordinator) == 1  # no rank can read epoch 2
    with pytest.raises(Fenced):
        coordinator._complete(by_rank=0)
    assert COMPLETE not in journal.records and not coordinator.store.check([P.COMPLETE])


def test_a_successor_starts_from_the_journals_last_epoch():
    journal = MemoryJournal()
    first = coordinator_with(journal)
    first.state.mark_dead(2, "test")
    first.tick()
    successor = coordinator_with(journal, restarted=True)
    assert published_epoch(successor) == 1 and successor.state.dead == {2}
    successor.state.mark_dead(0, "test")
    successor.tick()  # numbering goes on: no epoch is published twice with two meanings
    assert published_epoch(successor) == 2 and journal.records[EPOCH]["record"]["dead"] == [0, 2]


def test_a_coordinator_that_cannot_reach_etcd_publishes_nothing():
    """Cut off from etcd's majority, this side may be a partition's minority: nothing it decides
    may reach a rank (the other side may have elected another coordinator already)."""
    journal = MemoryJournal()
    coordinator = coordinator_with(journal)
    journal.reachable = False
    coordinator.state.mark_dead(1, "test")
    with pytest.raises(Fenced, match="etcd unreachable"):
        coordinator.tick()
    assert published_epoch(coordinator) == 0
