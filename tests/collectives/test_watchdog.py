"""The watchdog that bounds operations whose wait() does not block the host (NCCL), with the fake
asynchronous NCCL-like backend of `fake_async` (no GPU needed)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from recover_patches.collectives import backends, watchdog as watchdog_module
from recover_patches.collectives.errors import PeerFailure
from recover_patches.collectives.process_group import ResilientProcessGroup
from recover_patches.collectives.watchdog import Watchdog, result_of, PENDING
from tests.collectives import fake_async
from tests.collectives.fake_async import FakeWork, Result
from tests.collectives.fake_world import FakeWorld, build_together

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def group():
    """Member 0 of a 2-member group on the fake backend, built with member 1 (threads), watched by
    its own watchdog (1 ms sweeps); works complete only when a test says so."""
    fabric = fake_async.Fabric()
    fake_async.install(fabric)
    world, watchdog = FakeWorld(), Watchdog(poll=0.001)
    g, other = build_together(world, "fake.g", [(0, 1), (0, 1)], backend=fake_async.NAME,
                              timeout=0.2, watchdog=watchdog)
    fabric.complete = False  # the warm-up all-reduces are done; from now on the test decides
    backend = next(b for b in fabric.made if b.group_rank == 0)
    yield g, backend, watchdog, world.member(0)
    for each in (g, other):
        each.shutdown()
    assert backends.join_discards(5.0)
    fake_async.uninstall()


def allreduce(g, backend) -> FakeWork:
    handle = g.allreduce([torch.ones(2)])
    handle.wait()  # returns at once, like NCCL's stream wait
    return backend.works[-1]


def test_a_healthy_run_never_latches(group):
    g, backend, watchdog, membership = group
    for _ in range(20):
        allreduce(g, backend).finish()  # the device finishes it a moment later
    deadline = time.monotonic() + 5
    while watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)  # past every deadline
    assert watchdog.pending() == 0 and not backend.aborted.is_set()
    g.raise_latched()  # nothing to raise
    assert membership.reports == []


def test_a_work_past_its_deadline_aborts_the_backend_and_latches_a_failure(group):
    g, backend, watchdog, membership = group
    work = allreduce(g, backend)  # never completes: a peer died inside the collective
    assert work.waited and not backend.aborted.is_set()  # the host was not blocked
    assert backend.aborted.wait(5.0)  # the watchdog aborted the communicator
    with pytest.raises(PeerFailure, match="no completion within") as latched:
        g.raise_latched()  # what the commit calls
    assert latched.value.suspects == {1} and not latched.value.confirmed
    with pytest.raises(PeerFailure, match="broken by an earlier failure"):
        g.allreduce([torch.ones(2)])  # and the next operation
    assert membership.reports and membership.reports[0][0] == [1]


@pytest.mark.parametrize("result", [Result.COMM_ERROR, Result.TIMEOUT])
def test_a_work_that_completes_with_an_error_is_latched_and_aborted_at_once(group, result):
    """NCCL: a completed NCCL work's WorkResult is read; an error is never a success."""
    g, backend, watchdog, _ = group
    g.timeout = 30.0  # only the result can end it in time
    allreduce(g, backend).finish(result)
    assert backend.aborted.wait(1.0)
    with pytest.raises(PeerFailure, match=f"work result {result.name}"):
        g.raise_latched()


def test_a_failed_communicator_fails_the_work_that_completed_on_it(group):
    g, backend, watchdog, _ = group
    g.timeout = 30.0
    backend.error = Result.COMM_ERROR  # Backend.get_error(): what NCCL saw asynchronously
    allreduce(g, backend).finish(Result.SUCCESS)
    assert backend.aborted.wait(1.0)
    with pytest.raises(PeerFailure, match="communicator error COMM_ERROR"):
        g.raise_latched()


def test_an_epoch_naming_a_member_aborts_pending_works_at_once(group):
    g, backend, watchdog, membership = group
    g.timeout = 30.0  # the deadline is far away: only the epoch can end the work in time
    allreduce(g, backend)
    assert watchdog.pending() == 1
    membership.world.declare_dead({1})
    assert backend.aborted.wait(1.0) and watchdog.pending() == 0
    with pytest.raises(PeerFailure):
        g.allreduce([torch.ones(2)])


class GlooLikeWork(FakeWork):
    """No future result ("not implemented", as gloo's), and an unreadable exception()."""

    def get_future_result(self):
        raise RuntimeError("getFutureResult not implemented")


def test_a_completed_work_whose_outcome_cannot_be_read_is_an_error():
    """NCCL: the TypeError of torch 2.11's binding made a failed work pass for a success."""
    now, expired = [0.0], []
    watchdog = Watchdog(clock=lambda: now[0], background=False)
    unreadable, late = GlooLikeWork(), FakeWork()
    watchdog.track("a", unreadable, 1.0, expired.append)
    watchdog.track("b", late, 1.0, expired.append)
    unreadable.finish()
    watchdog.sweep()
    assert len(expired) == 1 and "cannot be read" in expired[0]
    now[0] = 2.0
    watchdog.sweep()  # the sweep went on: the other lane's overdue work expires too
    assert watchdog.pending() == 0 and len(expired) == 2


def test_an_unpublished_result_is_not_yet_a_success():
    work = FakeWork()
    work.finish(publish=False)  # the device finished; torch's watchdog has not retired it yet
    assert result_of(work) is PENDING
    work.published.set()
    assert result_of(work) is None


class CountingWork(FakeWork):
    polls = 0

    def is_completed(self) -> bool:
        CountingWork.polls += 1
        return super().is_completed()


def test_a_sweep_polls_only_the_head_of_each_lane():
    """NCCL: the works of one stream run in order: only the oldest can be the stuck one."""
    watchdog = Watchdog(clock=lambda: 0.0, background=False)
    CountingWork.polls = 0
    for _ in range(50):
        watchdog.track("comm", CountingWork(), 1.0, lambda reason: None)
    for peer in (1, 2):  # p2p streams are lanes of their own
        watchdog.track("comm", CountingWork(), 1.0, lambda reason: None, lane=peer)
    watchdog.sweep()
    assert CountingWork.polls == 3 and watchdog.pending() == 52
    assert 0.02 <= watchdog_module.POLL_SECONDS <= 0.05


def test_deadlines_are_chained_from_when_a_work_can_start():
    """NCCL: a work queued behind a slow one does not time out only because it waited."""
    now, expired = [0.0], []
    watchdog = Watchdog(clock=lambda: now[0], background=False)
    slow, queued = FakeWork(), FakeWork()
    watchdog.track("a", slow, 1.0, expired.append)
    watchdog.track("a", queued, 1.0, expired.append)  # enqueued at 0 as well
    watchdog.sweep()
    now[0] = 0.9
    slow.finish()
    watchdog.sweep()  # `queued` is the head from here: its clock starts at 0.9
    now[0] = 1.5
    watchdog.sweep()
    assert expired == [] and watchdog.pending() == 1
    now[0] = 2.0
    watchdog.sweep()
    assert len(expired) == 1 and "within 1s of becoming able to start" in expired[0]


def test_a_work_whose_inputs_are_not_ready_is_not_timed():
    """NCCL: on a GPU the probe is a CUDA event recorded when the work was enqueued (the
    compute before it, e.g. a pipeline warm-up, may take longer than the timeout)."""
    now, expired, ready = [0.0], [], [False]
    watchdog = Watchdog(clock=lambda: now[0], background=False)
    watchdog.track("a", FakeWork(), 1.0, expired.append, ready=lambda: ready[0])
    for t in (0.0, 3.0, 5.0):
        now[0] = t
        watchdog.sweep()
    assert expired == []
    ready[0] = True
    watchdog.sweep()  # inputs ready at 5.0
    now[0] = 5.9
    watchdog.sweep()
    assert expired == []
    now[0] = 6.1
    watchdog.sweep()
    assert len(expired) == 1


def test_forgetting_an_owner_drops_its_lanes():
    watchdog = Watchdog(clock=lambda: 0.0, background=False)
    watchdog.track("b", FakeWork(), 1.0, lambda reason: None)
    watchdog.track("b", FakeWork(), 1.0, lambda reason: None, lane=3)
    watchdog.forget("b")  # its backend was discarded: nothing left to watch
    assert watchdog.pending() == 0


def test_a_results_integer_is_read_by_name():
    """ProcessGroupNCCL's future holds WorkResult's bare integer (0 read as a failure stopped every
    NCCL connect on an H200): 0 is a success, any other value the failure it names."""
    from tests.collectives.fake_async import Result
    ok, failed = FakeWork(), FakeWork()
    ok.finish()
    failed.finish(Result.COMM_ERROR)
    assert ok.get_future_result().value() == 0
    assert result_of(ok) is None
    assert result_of(failed) == "work result COMM_ERROR"


def test_a_synchronous_collective_without_a_work_is_watched_on_its_stream(group):
    """torch >= 2.8's NCCL returns no work for `async_op=False` (megatron-core's TP all-reduces):
    it ran in stream order. It is no failure (taken for one, it stopped every TP > 1 job on an
    H200), and the stream is watched instead: completed, nothing latched; never completing, the
    communicator is aborted like any overdue work."""
    import torch.distributed as dist
    g, backend, watchdog, membership = group
    fabric = backend.fabric
    dist.all_reduce(torch.ones(2), group=g)  # returns: the kernel is ordered on the stream
    fabric.stream[-1].finish()
    deadline = time.monotonic() + 5
    while watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert watchdog.pending() == 0 and membership.reports == []
    g.raise_latched()
    dist.all_reduce(torch.ones(2), group=g)  # a peer died inside it: the stream never passes it
    assert backend.aborted.wait(5.0)
    with pytest.raises(PeerFailure, match="no completion within"):
        g.raise_latched()


class BrokenWork(FakeWork):
    def is_completed(self) -> bool:
        raise RuntimeError("a sweep that raises")


@pytest.mark.parametrize("trouble", ["stuck", "raising sweep", "stuck holding its lock",
                                     "none (control)"])
def test_the_backstop_fences_a_watchdog_that_stops_sweeping(trouble):
    """Works pending and no sweep completing for `limit`: the guard fences (once). A sweep that
    raises leaves the thread alive (it keeps trying) but completes no sweep. A thread stuck
    holding the watchdog's lock (on an H200, the epoch watcher in a destructor) must not stop
    the backstop too. Control: a healthy watchdog with a work pending is never fenced."""
    dog, fenced = Watchdog(poll=0.01), []
    guard = dog.guard(0.3, fenced.append)
    release = threading.Event()
    try:
        work = BrokenWork() if trouble == "raising sweep" else FakeWork()
        dog.track(object(), work, timeout=60, on_expired=lambda reason: None)
        if trouble == "stuck":
            dog.stall()
        if trouble == "stuck holding its lock":
            holding = threading.Event()
            threading.Thread(target=hold, args=(dog._cond, holding, release), daemon=True).start()
            assert holding.wait(5.0)
        time.sleep(1.0)
        assert len(fenced) == (0 if trouble.startswith("none") else 1), fenced
        if fenced:
            assert "has not completed a sweep" in fenced[0]
        assert dog._thread is not None and dog._thread.is_alive()
    finally:
        release.set()
        guard.close()


def hold(lock, holding: threading.Event, release: threading.Event) -> None:
    with lock:
        holding.set()
        release.wait(10.0)


def test_a_member_that_left_is_asked_after_a_quarter_of_the_timeout():
    """The departure probe is a store look-up: asked only once a work waited T/4, then every
    T/4; a yes expires the work at once, long before T."""
    now, asked = [0.0], []
    dog = Watchdog(clock=lambda: now[0], background=False)
    expired: list[str] = []
    dog.track(object(), FakeWork(), timeout=8, on_expired=expired.append,
              left=lambda: asked.append(now[0]) or len(asked) >= 2)
    for t in (0.0, 1.0, 2.5, 3.0, 4.6):
        now[0] = t
        dog.sweep()
    assert asked == [2.5, 4.6] and expired == ["a member gave up on the group's backend"]
