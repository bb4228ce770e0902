"""The coordinator's evidence that a rank is alive and moving: pure bookkeeping, no I/O (design.md §6).

Every heartbeat carries a beat counter and the rank's progress (where it is: epoch, iteration,
phase, microbatch, and a count of its progress marks; see `MembershipClient.mark`). From these
and the ranks' timeout reports come two verdicts:

  * silent: the beat has not moved for `stall` seconds -- the process is stopped, or its node gone;
  * stuck:  some member reported that an operation timed out (it waits for others), and a member
    it suspects has not reported a timeout itself and has not made progress for `stall` seconds:
    that is the rank the others wait for (a stuck kernel, a deadlocked thread, a rank stalled far
    past the others). Its heartbeat thread may beat on; it is declared dead all the same.

A rank that is waiting never looks stuck: it reports its timeout within GRACE of it, and its
progress was marked when it started the operation it waits in, at most T (`--recover-timeout`)
earlier. A waiter's report counts only in the epoch it was made in and for `expiry` seconds (the
waiters give up after that). When waiters exist and no one can be named (every rank they wait for
waits too, or keeps moving: a partition, or a rank slower than T that still makes progress),
`unresolved()` says what was seen, for the coordinator's log.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from recover_patches.collectives.progress_marks import STARTING


@dataclass
class Seen:
    beat: str
    progress: str
    beat_at: float
    progress_at: float
    startup: float = 0.0  # the silence allowed while its progress says it is starting

    def allowed_silence(self, stall: float) -> float:
        starting = not self.progress or self.progress.endswith(STARTING)
        return max(stall, self.startup) if starting else stall


@dataclass(frozen=True)
class Waiter:
    suspects: frozenset[int]  # empty: the waiter cannot tell whom it waits for
    since: float
    where: str


class Liveness:
    def __init__(self, stall: float, expiry: float, clock: Callable[[], float] = time.monotonic):
        self.stall, self.expiry, self.clock = stall, expiry, clock
        self.seen: dict[int, Seen] = {}
        self.waiters: dict[int, Waiter] = {}
        self.epoch = 0

    def watch(self, rank: int, startup: float = 0.0) -> None:
        """Start (or restart) watching `rank`, as if it had just beaten and moved. Until its
        progress stops saying it is starting (an iteration committed), a silence of up to
        `startup` (--distributed-timeout-minutes) is no death: eight ranks importing on two
        cores once held a launcher's node beats back 5 s, and every rank was declared dead."""
        now = self.clock()
        self.seen[rank] = Seen("", "", now, now, startup)

    def forget(self, rank: int) -> None:
        self.seen.pop(rank, None)
        self.waiters.pop(rank, None)

    def watched(self) -> list[int]:
        return list(self.seen)

    def observe(self, rank: int, heartbeat: str | None) -> None:
        """A heartbeat value read from the store: "<beat> <progress...>" (None: not written yet)."""
        seen = self.seen.get(rank)
        if seen is None or heartbeat is None:
            return
        beat, _, progress = heartbeat.partition(" ")
        now = self.clock()
        if beat != seen.beat:
            seen.beat, seen.beat_at = beat, now
        if progress != seen.progress:
            seen.progress, seen.progress_at = progress, now

    def waiting(self, rank: int, suspects: Iterable[int], epoch: int, where: str) -> None:
        """`rank` reported that an operation of `epoch` timed out or broke."""
        if epoch >= self.epoch:
            self.waiters[rank] = Waiter(frozenset(suspects), self.clock(), where)

    def new_epoch(self, epoch: int) -> None:
        """A verdict was published: what the waiters waited for is settled."""
        self.epoch = epoch
        self.waiters.clear()

    def silent(self) -> list[tuple[int, str]]:
        now = self.clock()
        return [(r, f"no heartbeat for {now - s.beat_at:.1f}s")
                for r, s in self.seen.items() if now - s.beat_at > s.allowed_silence(self.stall)]

    def _current_waiters(self) -> dict[int, Waiter]:
        now = self.clock()
        for rank in [r for r, w in self.waiters.items() if now - w.since > self.expiry]:
            del self.waiters[rank]
        return self.waiters

    def _awaited(self, members: set[int]) -> set[int]:
        """The members some waiter waits for, that are not waiting themselves."""
        waiters = self._current_waiters()
        awaited: set[int] = set()
        for w in waiters.values():
            awaited |= w.suspects or members
        return (awaited & members) - set(waiters)

    def stuck(self, members: set[int]) -> list[tuple[int, str]]:
        """Members the waiters wait for that made no progress for `stall` seconds."""
        now = self.clock()
        stuck = []
        for r in sorted(self._awaited(members)):
            s = self.seen.get(r)
            if s is not None and now - s.progress_at > self.stall:
                stuck.append((r, f"no progress for {now - s.progress_at:.1f}s (at {s.progress or '?'}) "
                                 f"while rank(s) {sorted(self.waiters)} waited for it"))
        return stuck

    def unresolved(self, members: set[int]) -> str | None:
        """When waiters have waited `stall` seconds and no one is stuck: what was seen."""
        waiters = self._current_waiters()
        if not waiters or self.clock() - min(w.since for w in waiters.values()) < self.stall:
            return None
        moving = sorted(self._awaited(members))
        return (f"rank(s) {sorted(waiters)} report timeouts "
                f"({'; '.join(sorted({w.where for w in waiters.values()}))[:200]}) but no rank can be "
                "named: " + (f"rank(s) {moving} they wait for still make progress (slower than "
                             "--recover-timeout: raise it)" if moving else
                             "every rank they wait for reports a timeout too (a network partition?)"))
