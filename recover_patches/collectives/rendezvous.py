"""Where the members of one group meet on the coordinator's store before its backend is rebuilt,
and decide together whether it needs rebuilding at all.

A group's backend can be kept across a recovery only if its message sequence is intact on every
member: no member broke it (an operation failed, or it was abandoned while peers may have been
blocked on it), none has an operation issued and not waited, and the members did not change.
Each member knows only its own side, so each one that finds its side dirty raises one flag
before it counts itself in; once all have counted in, every member reads the same flag, and so
takes the same decision. A dirty group is rebuilt by all its members, a clean one by none: a
member can never keep a backend that another one replaced.

Shrinking (NCCL >= 2.27) is decided the same way: only if every remaining member still holds
the same parent communicator (named by the rendezvous that built it) can they all shrink it.
Recovery only: a failure-free iteration meets nobody here.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Meeting:
    rebuild: bool  # some member's side was dirty: every member replaces the backend
    shrink: bool  # ... and every member can shrink the same parent instead of re-creating it


class NewerEpoch(Exception):
    """A newer membership epoch started while waiting: the attempt is over on every member."""


class MembersMissing(Exception):
    def __init__(self, missing: list[int], timeout: float):
        super().__init__(f"members {missing} did not arrive in {timeout:g}s")
        self.missing = missing


def meet(store, prefix: str, me: int, members: Sequence[int], timeout: float, *,
         dirty: bool = True, parent: str | None = None,
         newer_epoch: Callable[[], bool] = lambda: False, issued: int = 0) -> Meeting:
    """Count in at `prefix` and wait for every member. `dirty`: this member cannot keep the
    backend. `parent`: the rendezvous prefix of a retired backend this member could shrink.
    `issued`: operations this member issued on the backend; a backend is kept only if every
    member issued as many (NCCL matches by order: one extra operation on one member, cut short
    or taken on a path the others did not take, would pair every later one wrongly)."""
    if dirty:  # before the count: whoever sees the count complete sees the flag too
        store.set(f"{prefix}dirty", "1")
    else:
        store.add(f"{prefix}issued/{issued}", 1)
    if parent is not None:
        store.add(f"{prefix}parent/{parent}", 1)
    store.set(f"{prefix}arrived/{me}", "1")
    if store.add(f"{prefix}count", 1) == len(members):
        store.set(f"{prefix}ready", "1")
    # polled like the agreement's barriers (0.5 -> 5 ms): a timed-out TCPStore.wait() leaves
    # the shared client's connection unusable, so no blocking wait with a deadline here
    deadline, pause = time.monotonic() + timeout, 0.0005
    while not store.check([f"{prefix}ready"]):
        if newer_epoch():
            raise NewerEpoch()
        if time.monotonic() > deadline:
            raise MembersMissing([m for m in members if not store.check([f"{prefix}arrived/{m}"])],
                                 timeout)
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    rebuild = dirty or store.check([f"{prefix}dirty"]) or \
        store.add(f"{prefix}issued/{issued}", 0) != len(members)
    shrink = rebuild and parent is not None and \
        store.add(f"{prefix}parent/{parent}", 0) == len(members)
    return Meeting(rebuild, shrink)


@dataclass(frozen=True)
class Regroup:
    """What the members of a group decided at one rendezvous (the same on each of them)."""
    epoch: int
    members: tuple[int, ...]
    prefix: str
    meeting: Meeting


@dataclass(frozen=True)
class Retired:
    """A backend set aside when an epoch declared a member dead, to be shrunk by the others."""
    backend: object
    members: tuple[int, ...]
    prefix: str  # the rendezvous that built it: the same on every member that holds it

    def shrinks_to(self, members: tuple[int, ...]) -> bool:
        return len(members) < len(self.members) and \
            members == tuple(m for m in self.members if m in members)


@dataclass
class Regrouped:
    """Which groups a regroup kept, shrank or re-created (names), for the recovery record."""
    kept: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    shrunk: list[str] = field(default_factory=list)
    connect_seconds: float = 0.0  # spent creating or shrinking backends (the rest: rendezvous)

    def add(self, name: str, outcome: str) -> None:
        {"kept": self.kept, "rebuilt": self.rebuilt, "shrunk": self.shrunk}[outcome].append(name)


def apply_all(plans: list) -> Regrouped:
    """Carry out each group's meeting decision, `plans` = [(group, Regroup)]. On NCCL the new
    communicators connect concurrently (1-10 s each); the first PeerFailure is raised after all
    ended."""
    start = time.perf_counter()
    if any(not g.host_waits for g, _ in plans):
        with ThreadPoolExecutor(max(1, len(plans)), thread_name_prefix="recover-regroup") as pool:
            done = [pool.submit(g.apply, plan) for g, plan in plans]
        outcomes = [f.result() for f in done]
    else:
        outcomes = [g.apply(plan) for g, plan in plans]
    report = Regrouped(connect_seconds=time.perf_counter() - start)
    for (g, _), outcome in zip(plans, outcomes):
        report.add(g.label, outcome)
    return report
