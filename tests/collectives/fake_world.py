"""Several ranks of one job as threads of the test process: a shared in-process store and a
membership that a test advances by hand (no coordinator, no heartbeats), so the rendezvous and
regroup logic of ResilientProcessGroup runs between real members without starting processes."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from recover_patches.collectives.errors import MembershipTimeout
from recover_patches.collectives.process_group import ResilientProcessGroup


class FakeWorld:
    def __init__(self):
        self.store = dist.HashStore()
        self.epoch, self.dead = 0, frozenset()
        self.changed = threading.Condition()
        self._members: dict[int, FakeMembership] = {}

    def member(self, rank: int) -> "FakeMembership":
        if rank not in self._members:
            self._members[rank] = FakeMembership(self, rank)
        return self._members[rank]

    def declare_dead(self, ranks: set[int]) -> int:
        """The coordinator's verdict: a new epoch, announced to every member's listeners."""
        with self.changed:
            self.epoch, self.dead = self.epoch + 1, self.dead | frozenset(ranks)
            epoch, dead = self.epoch, self.dead
            self.changed.notify_all()
        for member in list(self._members.values()):
            for listener in list(member.listeners):
                listener(epoch, dead)
        return epoch

    def readmit(self, ranks: set[int]) -> int:
        """An epoch that declares no one dead: `ranks` (replaced) count as members again, as
        when a replica grows back."""
        with self.changed:
            self.dead = self.dead - frozenset(ranks)
        return self.declare_dead(set())


class FakeMembership:
    heartbeat_timeout, heartbeat_interval = 1.0, 0.1

    def __init__(self, world: FakeWorld, rank: int):
        self.world, self.rank, self.store = world, rank, world.store
        self.backend_store = world.store
        self.reports: list[tuple[list[int], str]] = []
        self.listeners: list = []

    def epoch(self) -> int:
        return self.world.epoch

    def view(self) -> tuple[int, frozenset[int]]:
        with self.world.changed:
            return self.world.epoch, self.world.dead

    def dead_ranks(self) -> frozenset[int]:
        return self.world.dead

    def mark(self, where, iteration=None, microbatch=None) -> None:
        pass

    def settle(self) -> None:
        self.settled = True  # start-up is over: its store's answers would be bounded by T

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners.remove(listener)

    def report_failure(self, suspects, where) -> None:
        self.reports.append((sorted(suspects), where))

    def wait_for_epoch_after(self, epoch: int, timeout: float) -> int:
        with self.world.changed:
            if not self.world.changed.wait_for(lambda: self.world.epoch > epoch, timeout):
                raise MembershipTimeout(f"no epoch after {epoch} within {timeout:g}s")
            return self.world.epoch


def together(calls: Sequence, timeout: float = 20.0) -> list:
    """Run one call per member at once, each on a thread of its own; their results, in order.
    The first exception is raised after all calls ended; TimeoutError if one has not ended
    within `timeout` seconds.

    A thread of its own, never a pool's: a rank's thread is its compute stream under the
    emulated NCCL, and a pool thread done with one member's asynchronous call took the next
    member's, queueing that member's collective behind the first one's on one stream: the two
    waited for each other (the suite's "swept_down_to(0)" failure)."""
    results: list = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as error:  # noqa: BLE001 -- handed to the caller
            errors[i] = error
    threads = [threading.Thread(target=run, args=(i,), name=f"member-{i}", daemon=True)
               for i in range(len(calls))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"{sum(t.is_alive() for t in threads)} of {len(calls)} calls had "
                           f"not ended after {timeout:g}s")
    first = next((error for error in errors if error is not None), None)
    if first is not None:
        raise first
    return results


def build_together(world: FakeWorld, name: str, members_of: Sequence[Sequence[int]], *,
                   ranks: Sequence[int] | None = None, **options) -> list[ResilientProcessGroup]:
    """One group per rank (`ranks`, default 0..n-1), built at once as every member must."""
    ranks = list(ranks) if ranks is not None else list(range(len(members_of)))
    options.setdefault("verdict_timeout", 0.0)
    options.setdefault("build_timeout", 5.0)
    options.setdefault("timeout", 5.0)
    return together([lambda r=r, m=m: ResilientProcessGroup(name, m, membership=world.member(r),
                                                            **options)
                     for r, m in zip(ranks, members_of)])
