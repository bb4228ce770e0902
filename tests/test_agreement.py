"""Store agreements decide once for everyone, also when a rank gives up waiting."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from recover_patches.collectives import protocol
from recover_patches.collectives.errors import PeerFailure
from recover_patches.recovery.agreement import Decision, RecoveryStalled, StoreAgreement


class FakeMembership:
    def __init__(self, store, rank, epoch=0, dead=()):
        self.store, self.rank, self._epoch, self._dead = store, rank, epoch, frozenset(dead)

    def epoch(self):
        return self._epoch

    def dead_ranks(self):
        return self._dead

    def view(self):
        return self._epoch, self._dead


def test_a_rank_that_gives_up_waiting_decides_abort_for_everyone():
    store = dist.HashStore()
    impatient = StoreAgreement(FakeMembership(store, 0), timeout=0.05)
    with pytest.raises(PeerFailure):
        impatient.commit_vote("7/after0", [0, 1], reduced_ok=True)
    late = StoreAgreement(FakeMembership(store, 1), timeout=1.0)
    # rank 1 completes the set of "done" reports, but rank 0 already left this round
    assert late.commit_vote("7/after0", [0, 1], reduced_ok=True) is Decision.ABORT


def test_all_done_commits_and_a_dead_member_without_done_aborts():
    store = dist.HashStore()
    a, b = (StoreAgreement(FakeMembership(store, r), timeout=1.0) for r in (0, 1))
    store.set("recover/commit/1/after0/done/1", "1")
    store.add("recover/commit/1/after0/count", 1)
    assert a.commit_vote("1/after0", [0, 1], reduced_ok=True) is Decision.COMMIT
    dying = StoreAgreement(FakeMembership(store, 0, epoch=1, dead={1}), timeout=1.0)
    assert dying.commit_vote("2/after0", [0, 1], reduced_ok=True) is Decision.ABORT


def test_epoch_agreement_takes_the_first_proposal_and_stalls_cleanly():
    store = dist.HashStore()
    for e, dead in ((1, [3]), (2, [3, 5])):
        store.set(protocol.epoch_key(e), json.dumps({"epoch": e, "dead": dead, "reason": ""}))
    first = StoreAgreement(FakeMembership(store, 0, epoch=1, dead={3}), timeout=1.0)
    later = StoreAgreement(FakeMembership(store, 1, epoch=2, dead={3, 5}), timeout=1.0)
    assert first.agree_on_epoch("4/0", since_epoch=0) == (1, frozenset({3}))
    assert later.agree_on_epoch("4/0", since_epoch=0) == (1, frozenset({3}))
    with pytest.raises(RecoveryStalled):  # nobody declared dead: do not retry forever
        StoreAgreement(FakeMembership(store, 0, epoch=2), timeout=0.05).agree_on_epoch("4/1", 2)


def test_news_of_a_newer_epoch_from_any_voter_turns_the_commit_into_a_sync():
    store = dist.HashStore()
    a, b = (StoreAgreement(FakeMembership(store, r), timeout=1.0) for r in (0, 1))
    store.set("recover/commit/3/after0/news", "1")  # rank 1 saw a grow epoch and voted first
    store.set("recover/commit/3/after0/done/1", "1")
    store.add("recover/commit/3/after0/count", 1)
    assert a.commit_vote("3/after0", [0, 1], reduced_ok=True) is Decision.COMMIT_AND_SYNC
    assert b.commit_vote("3/after0", [0, 1], reduced_ok=True) is Decision.COMMIT_AND_SYNC
    assert a.commit_vote("4/after0", [0], reduced_ok=True, news=True) is Decision.COMMIT_AND_SYNC
    assert a.commit_vote("5/after0", [0], reduced_ok=True) is Decision.COMMIT


def test_the_first_join_announcement_wins_and_a_spare_gives_up_on_news():
    store = dist.HashStore()
    live, spare = (StoreAgreement(FakeMembership(store, r), timeout=1.0) for r in (0, 2))
    assert spare.wait_for_join(7, give_up=lambda: True) is None
    assert live.announce_join(7, {"live": [0, 1, 2]}) == {"live": [0, 1, 2]}
    assert live.announce_join(7, {"live": [0, 1]}) == {"live": [0, 1, 2]}
    assert spare.wait_for_join(7, give_up=lambda: False) == {"live": [0, 1, 2]}
