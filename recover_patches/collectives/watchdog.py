"""One thread per process that bounds the operations whose wait() does not block the host.

On NCCL, `work.wait()` only makes the current CUDA stream wait: the host runs ahead and queues
more kernels, and a collective stuck on a dead peer would hang the stream, not the caller. So
every such work is handed to the watchdog. A work that ended in an error, or that has not ended
`timeout` seconds after it *could start*, is reported through `on_expired` -- the group aborts
its communicator (which unblocks the stuck kernels) and latches a PeerFailure that its next
operation, or the commit, raises.

Why queues and heads: the works of one lane (a communicator's collective stream, or its stream
to one p2p peer) run in order, so only the oldest unfinished one can be the stuck one, and only
it is polled: a sweep costs O(lanes), not O(works in flight). The deadline of a work counts
from the sweep that first saw it at the head of its lane (its predecessor done) and -- with a
`ready` probe (a CUDA event recorded on the compute stream when it was enqueued) -- its inputs
ready: a multi-GB transfer queued behind others, or a collective queued during a pipeline
warm-up, does not time out only because it waited its turn.

Why 20 ms: the sweep runs Python on a thread of the training process; polling every 2 ms took
the GIL from the thread that launches kernels. A hang is declared seconds after it starts, so a
20 ms sweep changes detection by at most 20 ms.

Who watches the watchdog: a sweep that raises is logged and the loop goes on; a thread that died
is started again by the next `track`; and `guard()` fences the rank (the entry point ends the
process, so the coordinator declares it) when works have been pending for `limit` seconds with
no sweep completing -- the watchdog stuck, or dead with nothing tracked since. torch's own
backstop is off by design (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), so without this a stuck watchdog
would leave a stuck collective unbounded.

gloo works are not watched: their wait() blocks the caller inside the backend, bounded by gloo's
own timeouts, and fails within milliseconds when a peer's process dies or drops the group.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.02


class AsyncWork(Protocol):
    """What the watchdog reads of a torch Work (NCCL's; a test's fake)."""
    def is_completed(self) -> bool: ...

    def get_future_result(self) -> Any: ...  # a Future of WorkResult; gloo raises RuntimeError

    def exception(self) -> Any: ...


@dataclass
class Watched:
    work: AsyncWork
    timeout: float
    on_expired: Callable[[str], None]  # called once, on the watchdog thread, with the reason
    ready: Callable[[], bool] | None = None  # inputs ready (a CUDA event query); None: at enqueue
    since: float | None = None  # when its deadline started: the sweep that saw it head and ready
    left: Callable[[], bool] | None = None  # a member abandoned the backend (a store look-up)
    asked_at: float = 0.0  # when `left` was last asked


@dataclass
class Lane:
    owner: object  # what to forget together (a group's backend generation)
    works: deque[Watched] = field(default_factory=deque)


class Watchdog:
    """The pending works of every watched lane, oldest first; a sweep every `poll` seconds while
    any is pending, none while idle."""

    def __init__(self, poll: float = POLL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 background: bool = True):
        self.poll, self.clock = poll, clock
        self.background = background  # False: only explicit sweep() calls (tests drive the clock)
        self._cond = threading.Condition()
        self._lanes: dict[tuple[int, Hashable], Lane] = {}
        self._thread: threading.Thread | None = None
        self._sweeping = threading.Lock()  # one sweep at a time: a work expires once
        self._progress_at = clock()  # the last completed sweep, or when works became pending
        self._stalled = threading.Event()  # fault injection: the thread stops sweeping
        self._failed_sweeps = 0  # logged once

    def track(self, owner: object, work: AsyncWork, timeout: float,
              on_expired: Callable[[str], None], lane: Hashable = None,
              ready: Callable[[], bool] | None = None,
              left: Callable[[], bool] | None = None) -> None:
        """Watch `work` (an operation a backend ran in stream order and returned no work for
        comes as a `backends.StreamOrderedWork`: every operation is watched). `left`: asked
        once the work has waited a quarter of its timeout, then every quarter: a member gave
        up on the backend (NCCL tells nobody; gloo's peers see its sockets close)."""
        with self._cond:
            key = (id(owner), lane)
            if not self._lanes:  # idle until now: the stall clock starts here
                self._progress_at = self.clock()
            if key not in self._lanes:
                self._lanes[key] = Lane(owner)
            self._lanes[key].works.append(Watched(work, timeout, on_expired, ready, left=left))
            if self.background and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="recover-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, owner: object) -> int:
        """The owner's backend is gone (aborted, rebuilt): its works need no watching. Returns
        how many of them had not succeeded by now (asked of each: a sweep may lag)."""
        with self._cond:
            gone = [lane for lane in self._lanes.values() if lane.owner is owner]
            self._lanes = {k: v for k, v in self._lanes.items() if v.owner is not owner}
        # asked and let go of outside the lock: a work's destructor may wait (the driver's
        # lock), and the sweep and the backstop must not wait with it
        return sum(not _succeeded(w.work, owner) for lane in gone for w in lane.works)

    def pending(self) -> int:
        with self._cond:
            return sum(len(lane.works) for lane in self._lanes.values())

    def sweep(self) -> None:
        """One pass over the head of every lane: drop finished works, expire a failed or overdue
        head (and forget its lane: the owner aborts that communicator)."""
        with self._sweeping:
            with self._cond:
                lanes = list(self._lanes.items())
            expired = []
            for key, lane in lanes:
                reason = self._advance(lane)
                if reason is not None:
                    expired.append((lane.works[0], reason))
                    with self._cond:
                        self._lanes.pop(key, None)
                elif not lane.works:
                    with self._cond:
                        if not lane.works:
                            self._lanes.pop(key, None)
            for watched, reason in expired:
                watched.on_expired(reason)

    def _advance(self, lane: Lane) -> str | None:
        """Pop the lane's finished heads; the reason its head failed, or None."""
        now = self.clock()
        while lane.works:
            head = lane.works[0]
            if head.ready is not None:
                if not head.ready():  # its inputs are not there yet: its clock has not started
                    return None
                head.ready, head.since = None, now
            if head.since is None:  # it became the head (at most one sweep ago)
                head.since = now
            if head.work.is_completed():
                status = result_of(head.work, lane.owner)
                if status is PENDING:  # completed, but its result is not published yet
                    return None if now <= head.since + head.timeout else \
                        "completed, but its result never became readable"
                if status is not None:
                    return f"backend error: {status}"
                with self._cond:
                    finished = lane.works.popleft()
                del finished  # outside the lock (see `forget`)
                continue
            if now > head.since + head.timeout:
                return (f"no completion within {head.timeout:g}s of becoming able to start "
                        f"({now - head.since - head.timeout:.1f}s past it)")
            return self._member_left(head, now)
        return None

    @staticmethod
    def _member_left(head: Watched, now: float) -> str | None:
        """Asked a quarter of the timeout after the work could start, then every quarter."""
        since = head.since if head.since is not None else now
        if head.left is None or now < max(since, head.asked_at) + head.timeout / 4:
            return None
        head.asked_at = now
        return "a member gave up on the group's backend" if head.left() else None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._lanes))
            if self._stalled.is_set():
                threading.Event().wait()  # a stuck watchdog, for the backstop's test
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 -- guard: the thread must outlive a bad sweep
                if not self._failed_sweeps:
                    logger.exception("watchdog sweep failed; the backstop fences this rank if "
                                     "no sweep completes")
                self._failed_sweeps += 1
            else:
                self._progress_at = self.clock()
            time.sleep(self.poll)

    def stalled_for(self) -> float:
        """Seconds works have been pending with no sweep completing (0 while idle). Read
        without the lock: the backstop must answer while a thread holding it is stuck (on an
        H200 the epoch watcher was, in a destructor under it, and the backstop waited too)."""
        if not self._lanes:  # one read of a dict's size: atomic
            return 0.0
        return max(0.0, self.clock() - self._progress_at)

    def guard(self, limit: float, fence: Callable[[str], None]):
        """The backstop: `fence(why)` once, from a thread of its own, when the watchdog has
        stalled for `limit` seconds. Returns the guard (`close()` ends it)."""
        from recover_patches.collectives.self_fence import SelfFence
        return SelfFence(self.stalled_for, limit, fence, lambda stalled: (
            f"the collectives' watchdog has not completed a sweep for {stalled:.1f}s with "
            f"operations pending (limit {limit:g}s): nothing would bound a stuck collective"))

    def stall(self) -> None:
        """Fault injection: the watchdog thread stops at its next sweep, as if stuck."""
        self._stalled.set()


PENDING = object()  # a completed work whose result torch has not published yet


def _succeeded(work, backend) -> bool:
    try:
        return bool(work.is_completed()) and result_of(work, backend) is None
    except Exception:  # noqa: BLE001 -- unreadable: not known to have succeeded
        return False


def result_of(work, backend=None) -> object | None:
    """A completed work's error (None: it succeeded; PENDING: not known yet).

    NCCL works publish their outcome as `get_future_result()`, a Future of `WorkResult` that
    ProcessGroupNCCL's own watchdog fills in (COMM_ERROR, TIMEOUT; SUCCESS when it retires the
    work, up to its 100 ms loop later). gloo's raise "not implemented": then `exception()`
    decides. Its binding raised TypeError for every NCCL work on torch 2.11 (measured on an
    H100); a work whose outcome can be read neither way is an error, never a success: a failed
    collective must not be committed. The backend's own error state (`get_error()`, NCCL only)
    is read as well: a communicator that failed fails the work that completed on it."""
    try:
        future = work.get_future_result()
    except (AttributeError, RuntimeError):  # gloo: "getFutureResult not implemented"
        try:
            error = work.exception()
        except TypeError as unreadable:
            return f"its outcome cannot be read ({unreadable})"
        return error
    if not future.done():
        return PENDING
    result = _result_name(future.value())
    if result != "SUCCESS":
        return f"work result {result}"
    state = backend.get_error() if hasattr(backend, "get_error") else None
    if state is not None and _result_name(state) != "SUCCESS":
        return f"communicator error {_result_name(state)}"
    return None


# c10d's WorkResult (Work.hpp). The NCCL work's future holds the bare integer, not the enum: read
# on an H200 (torch 2.11, NCCL 2.28.9), where `0` taken for a failure stopped every connect.
_WORK_RESULTS = {0: "SUCCESS", 1: "TIMEOUT", 2: "COMM_ERROR", 100: "UNKNOWN"}


def _result_name(value: object) -> str:
    """An outcome's name, whether torch hands over an enum (`.name`) or its integer."""
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(value, int):
        return _WORK_RESULTS.get(value, str(value))
    return str(value)


WATCHDOG = Watchdog()  # the process's one watchdog
