"""The elected coordinator's journal: an epoch is journaled before any rank can read it, a
coordinator whose journal refuses (its node lost the lease) publishes nothing and stops, and a
successor starts from the journal's last epoch. In-process coordinators, an in-memory journal
(the fenced write itself is tested against etcd in `test_election.py`)."""
from __future__ import annotations

import json
import time

import pytest

from recover_patches.collectives import protocol as P
from recover_patches.collectives.coordinator import Coordinator, CoordinatorConfig, start_server
from recover_patches.collectives.journal import COMPLETE, EPOCH, STANDBYS, Fenced

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


def standby_waits(coordinator: Coordinator, standby: str) -> None:
    P.post_report(coordinator.store, P.Report.make("standby", id=standby))


def answer_for(coordinator: Coordinator, standby: str) -> str | None:
    if coordinator.store.queue_len(P.standby_key(standby)) == 0:
        return None
    return coordinator.store.queue_pop(P.standby_key(standby), False).decode()


def test_a_standbys_slot_is_journaled_first_and_a_successor_never_gives_it_twice():
    journal = MemoryJournal()
    first = coordinator_with(journal)
    standby_waits(first, "9.0")
    first.state.on_exit(2, -9, replacing=False)  # its launcher starts no replacement
    first.tick()
    given = {"rank": 2, "incarnation": 1}
    assert journal.records[STANDBYS] == {"grants": [[2, "9.0", 1]]}
    assert json.loads(answer_for(first, "9.0")) == given
    # The first coordinator's node is lost before standby 9.0 registered. A successor: another
    # standby waits, and 9.0 registers as waiting again (as if its answer had been lost).
    successor = coordinator_with(journal, restarted=True)
    standby_waits(successor, "9.1")
    standby_waits(successor, "9.0")
    successor.tick()
    assert json.loads(answer_for(successor, "9.0")) == given  # the answer, sent again
    time.sleep(successor.state.standby_grace + 0.1)  # a dead slot nobody holds is given away now
    successor.tick()
    assert answer_for(successor, "9.1") is None  # rank 2 is 9.0's: not given again
    assert json.loads(successor.store.get(P.assigned_key("9.0"))) == given  # for its launcher
    assert successor.state.refuse_reason(2, 1, standby="9.0") is None
    assert successor.state.refuse_reason(2, 2, standby="9.1").startswith(P.SLOT_TAKEN)


def test_a_fenced_coordinator_gives_no_slot_to_a_standby():
    journal = MemoryJournal()
    coordinator = coordinator_with(journal)
    coordinator.state.on_exit(2, -9, replacing=False)
    coordinator.tick()  # epoch 1 journaled and published; no standby waits yet
    journal.leading = False
    standby_waits(coordinator, "9.0")
    with pytest.raises(Fenced):
        coordinator.tick()
    assert answer_for(coordinator, "9.0") is None and STANDBYS not in journal.records
