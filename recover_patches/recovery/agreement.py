"""Decisions every survivor must take identically, made through the coordinator's store.

Two questions need one answer across ranks even when failures strike between them:
  * did round k of iteration i commit? A training round decides it by its collectives and uses
    the store only once a failure interrupted it (`settle`: the protocol is in `settle.py`).
    An evaluation, and a join, vote (`commit_vote`): a reduction can complete on one rank and
    fail on another (a peer dies after sending its last message to some but not all), so each
    rank's local outcome is not enough. Rule: commit iff every member reported its reduction
    done. The first rank to know the answer writes it with compare_set; everyone follows the
    stored decision.
    With a `ReplicaLink`, the ranks of a replica first agree over their own group that all of
    them got this far, and only the replica's leader votes on the store and passes the decision
    back: O(replicas) store operations per commit instead of O(ranks).
  * which membership epoch does recovery attempt k use? Ranks may see a second failure at
    different moments; planning from different dead sets would split the survivors. The first
    proposal wins, and a barrier of all survivors closes the attempt (a newer epoch aborts it
    everywhere, so all retry together).
Both rely on the coordinator (outside the training ranks) and its TCPStore. If the coordinator
dies and a new one starts (empty store), a vote or barrier in progress is redone on the new store
once the membership client reconnected; every rank first re-publishes the last decision it read
and the last barrier it passed, so ranks still waiting for them find them there, whichever of
them reconnects first.

Store keys stay bounded: the last voter of a completed vote deletes the keys of the vote before
it (every member has voted again, so none still reads them), and the last rank to arrive at a
barrier does the same for the barrier before it. What remains grows with failures (epoch
agreements, aborted rounds), not with iterations.

A rank that gives up waiting for others (a vote, a barrier) reports it to the coordinator, like
a timed-out collective: the coordinator then names the rank they wait for if it stopped making
progress (`collectives/liveness.py`). Recovery waits `verdict_wait` for that verdict.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import torch.distributed as dist

from recover_patches.collectives import PeerFailure
from recover_patches.recovery import settle
from recover_patches.recovery.decision import Decision

T = TypeVar("T")

COMMIT, ABORT = Decision.COMMIT.value, Decision.ABORT.value
CODES = list(Decision)  # a decision travels inside a replica as its index here


@dataclass(frozen=True)
class ReplicaLink:
    """How the ranks of this rank's replica vote as one. `exchange(news)`: any rank's news, over
    the replica's group (a MAX); `share(code)`: the leader's code on every rank of the replica.
    Both raise PeerFailure. For a replica of one rank both are the identity."""
    replica_of: Callable[[int], int]
    leader: bool
    exchange: Callable[[bool], bool]
    share: Callable[[int], int]


class RecoveryStalled(RuntimeError):
    """Recovery cannot proceed: a failure was reported but the coordinator declared no one dead.
    Retrying would only wait again, so the job stops (checkpoint-restart)."""


class StoreAgreement:
    def __init__(self, membership, *, timeout: float, verdict_wait: float | None = None,
                 poll: float = 0.0005, max_poll: float = 0.005, replica: ReplicaLink | None = None):
        self.membership = membership
        self.rank = membership.rank
        self.timeout = timeout  # for the others to arrive (a vote, a barrier)
        self.verdict_wait = timeout if verdict_wait is None else verdict_wait  # for an epoch
        self.poll, self.max_poll = poll, max_poll
        self.replica = replica
        self.store_ops = 0  # by this rank's commit votes (evaluations, joins)
        self._previous_vote: list[str] = []  # keys of the vote before: see the module docstring
        self._previous_barrier: list[str] = []
        self._known: dict[str, str] = {}  # what this rank last read: re-published on a new store
        self._unreported: tuple[str, Decision] | None = None  # see note_commit
        self._rejoined_at = float("-inf")  # when this rank last came back to a successor
        if hasattr(membership, "add_reconnect_listener"):
            membership.add_reconnect_listener(self._republish)

    @property
    def store(self):
        return self.membership.store  # replaced when the coordinator restarts

    def _retire(self, slot: str, keys: list[str]) -> list[str]:
        """Remember `keys` as the latest vote's (or barrier's); return the ones of the one before
        to delete (none when the same one is run again after a coordinator restart)."""
        previous = getattr(self, slot)
        if previous == keys:
            return []
        setattr(self, slot, keys)
        return previous

    def _republish(self, store) -> None:
        self._rejoined_at = time.monotonic()  # (on the watcher thread, as the rank rejoined)
        for key, value in list(self._known.items()):
            store.compare_set(key, "", value)

    def _surviving_restarts(self, action: Callable[[], T]) -> T:
        """Run a store protocol; if the coordinator's store goes away meanwhile, or does not
        answer in time, register again (to it or its successor) and run it again from the start.
        The answer of an operation given up may still have been applied: the protocols count
        nothing twice (see `_vote_once`, `_barrier`)."""
        while True:
            generation = getattr(self.membership, "generation", 0)
            try:
                return action()
            except dist.DistNetworkError as lost:  # the main connection is lost or unanswered
                self.membership.reconnect_after(generation, lost)
                if not self.membership.wait_reconnected(generation):
                    raise

    def _sleep(self, pause: float) -> float:
        time.sleep(pause)
        return min(pause * 2, self.max_poll)

    def latest_epoch(self) -> int:
        """The newest membership epoch this rank has heard of (no store operation)."""
        return self.membership.epoch()

    def commit_vote(self, key: str, members: Iterable[int], reduced_ok: bool,
                    news: bool = False, per_rank: bool = False) -> Decision:
        """A commit iff every member's reduction for `key` completed (then all of them step).
        `news`: this rank saw a newer membership epoch; it costs one store operation, taken only
        by the last voter when nobody has news, and turns the commit into COMMIT_AND_SYNC.
        `per_rank`: every rank votes on the store even with a ReplicaLink (joins, rare)."""
        members, link = frozenset(members), self.replica
        self.membership.mark("commit")
        if link is None or per_rank:
            return self._vote(key, members, self.rank, lambda rank: rank, reduced_ok, news)
        mine = link.replica_of(self.rank)
        if not reduced_ok:
            return self._vote(key, members, mine, link.replica_of, False)
        try:
            news = link.exchange(news)
        except PeerFailure:  # a rank of this replica fell away; our own reduction completed
            return self._vote(key, members, mine, link.replica_of, False)
        code = -1
        if link.leader:
            code = CODES.index(self._vote(key, members, mine, link.replica_of, True, news))
        try:
            return CODES[link.share(code)]
        except PeerFailure:  # the leader is gone: the store has (or will have) the answer
            return self._vote(key, members, mine, link.replica_of, False)

    def _vote(self, key: str, members: frozenset[int], voter: int, voter_of: Callable[[int], int],
              reduced_ok: bool, news: bool = False) -> Decision:
        """One voter (a rank, or a replica's leader) votes; every voter follows the decision."""
        decision = self._surviving_restarts(
            lambda: self._vote_once(key, members, voter, voter_of, reduced_ok, news))
        self._known = {k: v for k, v in self._known.items() if not k.startswith("recover/commit/")}
        self._known[f"recover/commit/{key}/decision"] = decision.value
        return decision

    def _vote_once(self, key: str, members: frozenset[int], voter: int,
                   voter_of: Callable[[int], int], reduced_ok: bool, news: bool = False
                   ) -> Decision:
        prefix = f"recover/commit/{key}/"
        decision_key = prefix + "decision"
        voters = {voter_of(m) for m in members}
        done = [prefix + f"done/{v}" for v in sorted(voters)]
        previous = self._retire("_previous_vote", [prefix + "news", decision_key, *done])
        if reduced_ok:
            if news:  # before the done key: the last voter then sees it
                self._store("set", prefix + "news", "1")
            self._store("set", prefix + f"done/{voter}", "1")
            # the last to vote sees every done key (a count would count a vote made again
            # after its answer was lost twice, and decide before the last voter)
            if self._store("check", done):
                sync = news or self._store("check", [prefix + "news"])
                decided = Decision(self._store("compare_set", decision_key, "", (  # what is stored
                    Decision.COMMIT_AND_SYNC if sync else Decision.COMMIT).value).decode())
                for stale in previous:  # every voter voted again: nobody reads these any more
                    self._store("delete_key", stale)
                return decided
        else:  # a reduction failed: nobody can have all voters done
            return Decision(self._store("compare_set", decision_key, "", ABORT).decode())
        deadline, pause = time.monotonic() + self.timeout, self.poll
        while True:
            if self._store("check", [decision_key]):
                return Decision(self._store("get", decision_key).decode())
            dead = {voter_of(d) for d in self.membership.dead_ranks() & members}
            if any(not self.store.check([prefix + f"done/{v}"]) for v in dead):
                self.store.compare_set(decision_key, "", ABORT)
                continue
            if time.monotonic() > deadline:
                # Give up by *deciding* abort: walking away undecided would let the others
                # commit later while this rank recovers. If commit won the race, follow it.
                decided = Decision(self.store.compare_set(decision_key, "", ABORT).decode())
                if decided.committed:
                    return decided
                missing = [m for m in sorted(members)
                           if not self.store.check([prefix + f"done/{voter_of(m)}"])]
                self.membership.report_failure(missing, f"commit.vote {key}: no vote in "
                                                        f"{self.timeout:g}s")
                raise PeerFailure(self.membership.epoch(), missing, "commit.vote",
                                  f"members {missing} neither finished nor died in "
                                  f"{self.timeout:g}s", confirmed=False)
            pause = self._sleep(pause)

    # --- an interrupted training round (settle.py) -------------------------------------------
    def note_commit(self, key: str, decision: Decision) -> None:
        """This rank committed round `key` by its collectives (no store operation): the first
        time it uses the store again it reports so, for ranks whose round was interrupted."""
        self._unreported = (key, decision)

    def _report_commit(self) -> None:
        if self._unreported is not None:
            key, decision = self._unreported
            self._surviving_restarts(
                lambda: settle.report(self.store, key, self.rank, settle.COMMITTED, decision))
            self._unreported = None
            self._know_settled(key, decision)

    def _know_settled(self, key: str, decision: Decision) -> None:
        """Re-published on a new store: ranks still settling `key` find the decision there."""
        self._known = {k: v for k, v in self._known.items() if not k.startswith("recover/settle/")}
        self._known[settle.prefix_of(key) + "decision"] = decision.value

    def settle(self, key: str, members: Iterable[int], status: str) -> Decision:
        """The decision of round `key`, interrupted on this rank with `status` (settle.NOTHING or
        settle.SUM); the same on every member. A SUM rank waits for it; RecoveryStalled if
        nothing decides it within the timeout and the verdict wait."""
        self._report_commit()
        members = frozenset(members)
        self.membership.mark("commit")
        decided = self._surviving_restarts(lambda: self._settle(key, members, status))
        self._know_settled(key, decided)
        return decided

    def _settle(self, key: str, members: frozenset[int], status: str) -> Decision:
        decided = settle.report(self.store, key, self.rank, status)
        start, pause, reported = time.monotonic(), self.poll, False
        while decided is None:
            decided = settle.poll(self.store, key, members, self.membership.dead_ranks())
            if decided is not None:
                break
            waited = time.monotonic() - start
            if waited > self.timeout and not reported:  # the coordinator names the silent ones
                absent = settle.missing(self.store, key, members, self.membership.dead_ranks())
                self.membership.report_failure(absent, f"settle {key}: no status in "
                                                       f"{self.timeout:g}s")
                reported = True
            if waited > self.timeout + self.verdict_wait:
                raise RecoveryStalled(f"round {key} of the commit was not settled in "
                                      f"{waited:.1f}s: live members neither reported nor died")
            pause = self._sleep(pause)
        return decided

    def _store(self, op: str, *args):
        """A store operation of a commit vote, counted (`store_ops`)."""
        self.store_ops += 1
        return getattr(self.store, op)(*args)

    def agree_on_epoch(self, key: str, since_epoch: int) -> tuple[int, frozenset[int]]:
        """Wait until this rank sees an epoch after `since_epoch` (the last agreed one), propose
        it, and return the epoch -- and its dead set -- that won the proposal."""
        self._report_commit()
        return self._surviving_restarts(lambda: self._agree_on_epoch(key, since_epoch))

    def _agree_on_epoch(self, key: str, since_epoch: int) -> tuple[int, frozenset[int]]:
        decision_key = f"recover/epoch/{key}"
        self.membership.mark("recovery")
        deadline, pause = time.monotonic() + self.verdict_wait, self.poll
        while not self.store.check([decision_key]):
            epoch = self.membership.epoch()
            if epoch > since_epoch:
                self.store.compare_set(decision_key, "", str(epoch))
                break
            # (a successor, met meanwhile, names no one before its rejoin window closed: a stall)
            if time.monotonic() > max(deadline, self._rejoined_at + self.verdict_wait):
                raise RecoveryStalled(
                    f"a failure was seen but no rank was declared dead within "
                    f"{self.verdict_wait:g}s: every rank the others waited for either waited too "
                    "(a partition) or kept making progress (slower than --recover-timeout); the "
                    "coordinator's 'no verdict' line says which")
            pause = self._sleep(pause)
        agreed = int(self.store.get(decision_key).decode())
        return agreed, self.membership.dead_in(agreed)

    def barrier(self, key: str, members: Iterable[int], epoch: int, also: tuple[str, ...] = ()
                ) -> None:
        """All `members` reached recovery attempt `key` at `epoch`; a newer epoch declaring one of
        them dead abandons the attempt on every rank alike. `also`: keys read right after
        this barrier, deleted with it."""
        self._surviving_restarts(lambda: self._barrier(key, frozenset(members), epoch, also))
        passed = f"recover/barrier/{key}/all"
        self._known = {k: v for k, v in self._known.items() if not k.startswith("recover/barrier/")}
        self._known[passed] = "1"

    def _barrier(self, key: str, members: frozenset[int], epoch: int, also: tuple[str, ...]
                 ) -> None:
        self.membership.mark("barrier")
        prefix = f"recover/barrier/{key}/"
        arrived = [prefix + f"at/{m}" for m in sorted(members)]
        previous = self._retire("_previous_barrier", [prefix + "all", *arrived, *also])
        self.store.set(prefix + f"at/{self.rank}", "1")
        if self.store.check(arrived):  # the last to arrive (an arrival made again counts once)
            self.store.set(prefix + "all", "1")
            for stale in previous:  # every member arrived here: nobody reads these any more
                self.store.delete_key(stale)
        deadline, pause = time.monotonic() + self.timeout, self.poll
        while not self.store.check([prefix + "all"]):
            # Only a newer epoch that declares one of `members` dead stops the wait: an epoch that
            # adds a member (a replacement registering, at any moment) leaves every member able to
            # arrive, and its join happens at the next iteration boundary.
            if self.membership.epoch() > epoch and (lost := self.membership.dead_ranks() & members):
                raise PeerFailure(epoch, lost, "recovery.barrier",
                                  f"epoch {self.membership.epoch()} declared members {sorted(lost)} "
                                  "dead during the barrier")
            if time.monotonic() > deadline:
                self.membership.report_failure((), f"barrier {key}: not all arrived in "
                                                   f"{self.timeout:g}s")
                raise PeerFailure(epoch, (), "recovery.barrier",
                                  f"not all of {len(members)} survivors arrived in "
                                  f"{self.timeout:g}s", confirmed=False)
            pause = self._sleep(pause)

    def any_flag(self, key: str, members: Iterable[int], epoch: int, flag: bool) -> bool:
        """True on every member iff any member passed flag=True (e.g. one rank got SIGTERM)."""
        flag_key = f"recover/flag/{key}"
        if flag:
            self._surviving_restarts(lambda: self.store.set(flag_key, "1"))
            self._known = {k: v for k, v in self._known.items() if not k.startswith("recover/flag/")}
            self._known[flag_key] = "1"
        self.barrier(f"flag/{key}", members, epoch, also=(flag_key,))
        return self._surviving_restarts(lambda: self.store.check([flag_key]))

    # --- growing back: the live ranks tell waiting spares where to meet ----------------------
    def announce_join(self, epoch: int, record: dict) -> dict:
        """Publish what the live ranks decided for `epoch` (the first announcement wins; every
        caller gets the stored one back)."""
        key = f"recover/join/{epoch}"
        self.store.compare_set(key, "", json.dumps(record))
        return json.loads(self.store.get(key).decode())

    def wait_for_join(self, epoch: int, give_up: Callable[[], bool]) -> dict | None:
        """A spare waits (cheaply: store checks backing off to 50 ms) for the live ranks'
        announcement for `epoch`; None once `give_up()` is true (a newer epoch, job done)."""
        key, pause = f"recover/join/{epoch}", self.poll
        while not self.store.check([key]):
            if give_up():
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return json.loads(self.store.get(key).decode())

    def abandon_join(self, epoch: int) -> None:
        """The live ranks went on without the joiners of `epoch` (no newer epoch explained the
        failure): the spares report again for the next grow epoch."""
        self.store.set(f"recover/join/{epoch}/abandoned", "1")

    def join_abandoned(self, epoch: int) -> bool:
        return self.store.check([f"recover/join/{epoch}/abandoned"])
