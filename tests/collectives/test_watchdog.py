"""The watchdog that bounds operations whose wait() does not block the host (NCCL), with a fake
backend whose works complete asynchronously, as NCCL's do (no GPU needed)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from recover_patches.collectives import backends
from recover_patches.collectives.errors import PeerFailure
from recover_patches.collectives.process_group import ResilientProcessGroup
from recover_patches.collectives.watchdog import Watchdog

pytestmark = pytest.mark.timeout(30)


class FakeWork:
    def __init__(self):
        self.completed = threading.Event()
        self.error = None
        self.waited = False

    def is_completed(self) -> bool:
        return self.completed.is_set()

    def exception(self):
        return self.error

    def wait(self, timeout=None) -> bool:  # a stream wait: returns at once
        self.waited = True
        return True


class FakeBackend:
    """Looks like NCCL to `backends.discard` (name, abort)."""

    def __init__(self):
        self.works: list[FakeWork] = []
        self.aborted = threading.Event()

    def allreduce(self, tensors, opts):
        self.works.append(FakeWork())
        return self.works[-1]

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        self.aborted.set()


class FakeMembership:
    rank, heartbeat_timeout, heartbeat_interval, store = 0, 1.0, 0.1, None

    def __init__(self):
        self._epoch, self.reports, self.listeners = 0, [], []

    def epoch(self) -> int:
        return self._epoch

    def view(self):
        return self._epoch, frozenset()

    def dead_ranks(self):
        return frozenset()

    def mark(self, where, iteration=None, microbatch=None):
        pass

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners.remove(listener)

    def report_failure(self, suspects, where) -> None:
        self.reports.append((sorted(suspects), where))


@pytest.fixture
def group():
    """A 2-member group on the fake backend, watched by its own watchdog (1 ms sweeps)."""
    membership = FakeMembership()
    watchdog = Watchdog(poll=0.001)
    g = ResilientProcessGroup("fake.g", (0, 1), membership=membership, timeout=0.2,
                              backend="nccl", verdict_timeout=0.0, connect=False,
                              watchdog=watchdog)
    g._inner, g._failure, g._epoch = FakeBackend(), None, 0  # as after a build in epoch 0
    yield g, g._inner, watchdog, membership
    g.shutdown()
    assert backends.join_discards(5.0)


def allreduce(g) -> FakeWork:
    handle = g.allreduce([torch.ones(2)])
    handle.wait()  # returns at once, like NCCL's stream wait
    return g._inner.works[-1] if g._inner is not None else None


def test_a_healthy_run_never_latches(group):
    g, backend, watchdog, membership = group
    for _ in range(20):
        allreduce(g).completed.set()  # the device finishes it a moment later
    deadline = time.monotonic() + 5
    while watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)  # past every deadline
    assert watchdog.pending() == 0 and not backend.aborted.is_set()
    g.raise_latched()  # nothing to raise
    allreduce(g).completed.set()
    assert membership.reports == []


def test_a_work_past_its_deadline_aborts_the_backend_and_latches_a_failure(group):
    g, backend, watchdog, membership = group
    work = allreduce(g)  # never completes: a peer died inside the collective
    assert work.waited and not backend.aborted.is_set()  # the host was not blocked
    assert backend.aborted.wait(5.0)  # the watchdog aborted the communicator
    with pytest.raises(PeerFailure, match="no completion within the deadline") as latched:
        g.raise_latched()  # what the commit calls
    assert latched.value.suspects == {1} and not latched.value.confirmed
    with pytest.raises(PeerFailure, match="broken by an earlier failure"):
        g.allreduce([torch.ones(2)])  # and the next operation
    assert membership.reports and membership.reports[0][0] == [1]


def test_a_work_that_ends_in_an_error_is_latched_at_once(group):
    g, backend, watchdog, _ = group
    work = allreduce(g)
    work.error = RuntimeError("NCCL error: remote process exited")
    work.completed.set()
    assert backend.aborted.wait(0.1)  # far inside the 0.2 s deadline
    with pytest.raises(PeerFailure, match="remote process exited"):
        g.raise_latched()


def test_an_epoch_naming_a_member_aborts_pending_works_at_once(group):
    g, backend, watchdog, membership = group
    g.timeout = 30.0  # the deadline is far away: only the epoch can end the work in time
    allreduce(g)
    assert watchdog.pending() == 1
    membership._epoch = 1
    for listener in membership.listeners:  # the membership watcher thread announces it
        listener(1, frozenset({1}))
    assert backend.aborted.wait(1.0) and watchdog.pending() == 0
    with pytest.raises(PeerFailure):
        g.allreduce([torch.ones(2)])


def test_the_watchdog_sweeps_with_its_clock():
    now = [0.0]
    watchdog = Watchdog(clock=lambda: now[0])
    expired: list[str] = []
    slow, fast = FakeWork(), FakeWork()
    watchdog.track("a", slow, 1.0, expired.append)
    watchdog.track("a", fast, 1.0, expired.append)
    fast.completed.set()
    watchdog.sweep()
    assert watchdog.pending() == 1 and expired == []
    now[0] = 1.5
    watchdog.sweep()
    assert watchdog.pending() == 0 and len(expired) == 1 and "deadline" in expired[0]
    watchdog.track("b", FakeWork(), 1.0, expired.append)
    watchdog.forget("b")  # its backend was discarded: nothing left to watch
    assert watchdog.pending() == 0


class UnreadableWork(FakeWork):
    def exception(self):  # torch 2.11's NCCL binding, even after a success
        raise TypeError("Unable to convert function return value to a Python type!")


def test_a_work_whose_error_cannot_be_read_is_done_and_the_sweep_goes_on():
    now, expired = [0.0], []
    watchdog = Watchdog(clock=lambda: now[0])
    done, late = UnreadableWork(), FakeWork()
    watchdog.track("a", done, 1.0, expired.append)
    watchdog.track("a", late, 1.0, expired.append)
    done.completed.set()
    watchdog.sweep()
    assert watchdog.pending() == 1 and expired == []
    now[0] = 2.0
    watchdog.sweep()  # the watchdog still expires the overdue one
    assert watchdog.pending() == 0 and len(expired) == 1
