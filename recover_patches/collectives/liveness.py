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

Where a launcher forwards its node's beats (`node_beats.py`), the evidence for its ranks arrives
as one line per node per interval, 31,000 lines a second at 12,500 nodes: too many to parse in
Python. So a node's line is kept as it came (`observe_node`), and its ranks' records are brought
up to date from it only when a verdict needs them: when the line says its quietest rank has been
quiet for `stall` (or the node's lines stopped), or when a waiter waits for one of them. The scan
for silence then costs a comparison per node, plus one per rank that no line carries (a rank
beating on its own key, or one its node's launcher does not forward yet or any more).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from recover_patches.collectives.node_beats import NodeBeatLine, RankAges
from recover_patches.collectives.progress_marks import STARTING


@dataclass
class Seen:
    beat: str
    progress: str
    beat_at: float
    progress_at: float
    startup: float = 0.0  # the silence allowed while its progress says it is starting
    via: str | None = None  # the node whose launcher forwards its beat; None: its own key

    def allowed_silence(self, stall: float) -> float:
        starting = not self.progress or self.progress.endswith(STARTING)
        return max(stall, self.startup) if starting else stall


class NodeSeen:
    """A node's newest line, when it was taken, and since when none of its ranks was quiet.
    One record per node, updated in place (31,000 lines a second at 12,500 nodes)."""
    __slots__ = ("line", "at", "quiet_since", "carried", "_ages")

    def __init__(self, line: NodeBeatLine, at: float, carried: frozenset[int]):
        self.carried = carried
        self.update(line, at)

    def update(self, line: NodeBeatLine, at: float) -> None:
        self.line, self.at, self.quiet_since = line, at, at - line.stale
        self._ages: dict[int, RankAges] | None = None

    @property
    def ages(self) -> dict[int, RankAges]:  # parsed once per line, when first asked
        if self._ages is None:
            self._ages = self.line.ages()
        return self._ages


@dataclass(frozen=True)
class Waiter:
    suspects: frozenset[int]  # empty: the waiter cannot tell whom it waits for
    since: float
    where: str


RELAY_GRACE = 3.0  # x stall: a rank's launcher has until then to reach a restarted coordinator


class Liveness:
    def __init__(self, stall: float, expiry: float, clock: Callable[[], float] = time.monotonic):
        self.stall, self.expiry, self.clock = stall, expiry, clock
        self.seen: dict[int, Seen] = {}
        self.nodes: dict[str, NodeSeen] = {}
        self.loose: set[int] = set()  # watched ranks no line of their node carries (see above)
        self.waiters: dict[int, Waiter] = {}
        self.epoch = 0
        # an iteration committed (every member then was past start-up), or the job ends: a
        # rank's last beat may still say it is starting (its launcher forwards once per
        # interval), and a silence is judged by `stall` alone
        self.settled = False
        self._probed = 0  # the node lines looked at for a sign that start-up is over

    def watch(self, rank: int, startup: float = 0.0, via: str | None = None) -> None:
        """Start (or restart) watching `rank`, as if it had just beaten and moved. Until its
        progress stops saying it is starting (an iteration committed), a silence of up to
        `startup` (--distributed-timeout-minutes) is no death: eight ranks importing on two
        cores once held a launcher's node beats back 5 s, and every rank was declared dead.
        `via`: the node whose line speaks for it (a line of another node that still lists it,
        a dead launcher's last, does not)."""
        now = self.clock()
        self.seen[rank] = Seen("", "", now, now, startup, via)
        if self._node_of(rank) is None:
            self.loose.add(rank)
        else:
            self.loose.discard(rank)

    def probe_settled(self) -> None:
        """Until start-up is over, parse one node's line per sweep (a different one each time:
        a lost node's last line says `starting` for good) and settle once a rank there says it
        committed an iteration. No store operation, and nothing parsed once settled."""
        if self.settled or not self.nodes:
            return
        names = list(self.nodes)
        node = self.nodes[names[self._probed % len(names)]]
        self._probed += 1
        if any(not ages.where.endswith(STARTING) for ages in node.ages.values()):
            self.settle()

    def settle(self) -> None:
        """Start-up is over for every rank watched now: a node lost right after the first
        commit, whose last line still said its ranks were starting, is declared dead after
        `stall`, not start-up's bound. Ranks watched later (replacements) get their own."""
        if not self.settled:
            self.settled = True
            for seen in self.seen.values():
                seen.startup = 0.0

    def forget(self, rank: int) -> None:
        self.seen.pop(rank, None)
        self.waiters.pop(rank, None)
        self.loose.discard(rank)

    def watched(self) -> list[int]:
        return list(self.seen)

    def own_key(self) -> list[int]:
        """The watched ranks that beat on their own key."""
        return [r for r in self.loose if self.seen[r].via is None]

    def observe(self, rank: int, heartbeat: str | None) -> None:
        """A heartbeat value read from the store: "<beat> <progress...>" (None: not written yet)."""
        seen = self.seen.get(rank)
        if seen is None or heartbeat is None:
            return
        beat, _, progress = heartbeat.partition(" ")
        if progress and not progress.endswith(STARTING):
            self.settle()  # (a rank beating on its own key: its progress is read anyway)
        now = self.clock()
        if beat != seen.beat:
            seen.beat, seen.beat_at = beat, now
        if progress != seen.progress:
            seen.progress, seen.progress_at = progress, now

    def observe_node(self, line: NodeBeatLine) -> None:
        """A node's newest line. Its ranks are parsed only when the list changed: the ranks it
        no longer carries are brought up to date from its last line and scanned one by one."""
        now, last = self.clock(), self.nodes.get(line.node)
        if last is not None and last.line.ranks == line.ranks:
            last.update(line, now)
            return
        carried = line.carried()
        for rank in last.carried - carried if last is not None else ():
            if (seen := self._settle(rank)) is not None and seen.via == line.node:
                self.loose.add(rank)  # (its own node no longer carries it)
        self.nodes[line.node] = NodeSeen(line, now, carried)
        for rank in carried:
            if (seen := self.seen.get(rank)) is not None and seen.via == line.node:
                self.loose.discard(rank)

    def _node_of(self, rank: int) -> NodeSeen | None:
        """The node record that speaks for `rank`, if its newest line carries it."""
        seen = self.seen.get(rank)
        node = self.nodes.get(seen.via) if seen is not None and seen.via is not None else None
        return node if node is not None and rank in node.carried else None

    def _settle(self, rank: int) -> Seen | None:
        """`rank`'s record, brought up to date from its node's newest line (if one carries it):
        its beat and progress moved no later than that line says."""
        seen, node = self.seen.get(rank), self._node_of(rank)
        if seen is None or node is None:
            return seen
        ages = node.ages.get(rank)
        if ages is not None:
            seen.beat_at = max(seen.beat_at, node.at - ages.beat)
            seen.progress = ages.where
            seen.progress_at = max(seen.progress_at, node.at - ages.progress)
        return seen

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
        suspects = set(self.loose)
        for name, node in self.nodes.items():
            if now - node.quiet_since > self.stall:  # its lines stopped, or a rank is quiet
                suspects.update(r for r in node.carried if self.seen.get(r) is not None
                                and self.seen[r].via == name)
        silent = []
        for r in sorted(suspects):
            s = self._settle(r)
            if s is not None and now - s.beat_at > self._allowed(s):
                silent.append((r, f"no heartbeat for {now - s.beat_at:.1f}s"))
        return silent

    def _allowed(self, seen: Seen) -> float:
        """The silence that is no death yet. A rank whose launcher forwards its beats, when no
        line of that node reached this coordinator yet (it was just restarted: each launcher
        reconnects at most once a second, and on a loaded host 5 s after a restart every rank
        of a two-node job had been declared dead), gets RELAY_GRACE times more. A rank whose
        node's lines stopped is lost with its launcher, starting or not: past start-up after
        T + GRACE (a replacement on a node lost just after it registered kept the job's end
        waiting for start-up's bound); during start-up after RELAY_GRACE times that, since a
        launcher beside its ranks' imports on a loaded host is slow, not gone (a node lost in
        the first iteration of a job restarted from a checkpoint hung the chaos soak for
        start-up's bound, ten minutes)."""
        allowed = seen.allowed_silence(self.stall)
        node = self.nodes.get(seen.via) if seen.via is not None else None
        if seen.via is not None and node is None:
            allowed = max(allowed, RELAY_GRACE * self.stall)
        elif node is not None and self.clock() - node.at > self.stall:
            allowed = self.stall if self.settled else min(allowed, RELAY_GRACE * self.stall)
        return allowed

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
            s = self._settle(r)
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
