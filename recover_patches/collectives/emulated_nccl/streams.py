"""Device streams as NCCL and CUDA order them, on the CPU: the part of the emulated NCCL that
decides *when* things happen (the data moves in `communicator.py`).

  * A `DeviceOp` is one queued operation. It finishes when it ran (every member posted its side)
    or when its communicator is aborted; nothing else ends it and it has no timeout of its own.
  * A `Stream` runs its operations one after another on a worker thread, each only after the
    operations it was queued behind (the compute stream's, at enqueue) have finished.
  * The compute stream is the calling thread's (`current()`): it holds what the host queued on
    it without waiting -- synchronous collectives and `work.wait()` -- and a host read
    (`host_read()`) blocks the thread until every one of them finished, as `.item()` does after
    a stuck NCCL kernel. `event()` is a CUDA event recorded on it.
  * The driver's context lock (`driver()`, one per process): a host read waiting on the device
    holds it, and destroying an event on another thread waits until that read returns, as
    cudaEventDestroy waited for cudaStreamSynchronize on an H200 (torch 2.11, driver 580).
    Tests that run several ranks as threads of one process give each its own (`own_driver()`).
  * Single-queue mode (CUDA_DEVICE_MAX_CONNECTIONS=1): every stream of the process feeds one
    hardware queue, so an operation waits for everything queued before it on *any* stream.
"""
from __future__ import annotations

import atexit
import gc
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How long after an operation finished its result becomes readable (ProcessGroupNCCL's watchdog
# publishes WorkResult on its next loop, up to 100 ms later; a short delay keeps the rule visible)
PUBLISH_DELAY = 0.005
WORKER_PREFIX = "emulated-nccl-"  # the stream workers' thread names


class DeviceOp:
    """One queued operation: `run()` on its stream's worker, after every op of `after`."""

    _ids = itertools.count()

    def __init__(self, label: str, run: Callable[["DeviceOp"], None], after: list["DeviceOp"]):
        self.label, self.after = label, after
        self._run: Callable[[DeviceOp], None] | None = run
        self.id = next(self._ids)
        self.finished = threading.Event()
        self.wake = threading.Event()  # set by the transport's completion or by an abort
        self.failure: str | None = None
        self.finished_at: float | None = None
        self.remote_error: str | None = None  # reported while the stream stays stuck (`report`)

    def run(self) -> None:
        """On the stream's worker, once: the transport (unless an abort ended it first). The
        callable is dropped after: it holds the communicator, which must not outlive its users
        on another thread's last reference."""
        run, self._run = self._run, None
        if run is not None and not self.finished.is_set():
            run(self)

    def finish(self, failure: str | None = None) -> None:
        """Idempotent: the first outcome stands (an abort can race the transport)."""
        if self.finished.is_set():
            return
        self.failure, self.finished_at = failure, time.monotonic()
        self.finished.set()
        self.wake.set()

    def report(self, error: str) -> None:
        """The transport lost a member (NCCL over sockets: "Connection closed by remote peer"):
        the work reads as failed at once, as torch's watchdog marks it from the communicator's
        async error, but the kernel -- and the stream behind it -- waits for the abort, as an
        H200's host read did behind an all-reduce whose peer had exited."""
        self.remote_error = error

    def published(self) -> bool:
        return self.finished_at is not None and \
            time.monotonic() >= self.finished_at + PUBLISH_DELAY


class _Queue:
    """A worker thread running queued operations in order (a hardware queue)."""

    def __init__(self, name: str):
        self._items: queue.SimpleQueue[DeviceOp | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, op: DeviceOp | None) -> None:
        """An operation, or None: the worker ends once it reaches it."""
        self._items.put(op)

    def _loop(self) -> None:
        worker, name = threading.current_thread(), self.thread.name
        while (op := self._items.get()) is not None:
            worker.name = f"{name}: {op.label}"  # a stuck rank's stacks name what it waits for
            for earlier in op.after:
                earlier.finished.wait()
            op.run()
            worker.name = name


# Threads of the emulation that are ending (a closed stream's worker, a dropped transport's):
# the process's exit waits for them, bounded. A daemon thread still running when Python
# finalizes is ended inside whatever C++ destructor it was in when it next takes the GIL --
# a gloo work's, dropped as an aborted operation returns -- and a destructor cannot be
# unwound: "terminate called without an active exception", status 134, after a run that passed.
_ending: list[threading.Thread] = []
_ending_lock = threading.Lock()
EXIT_GRACE_SECONDS = 10.0  # bounded: a transport whose peer was stopped, not killed, never ends


def end_before_exit(thread: threading.Thread) -> None:
    with _ending_lock:
        _ending[:] = [t for t in _ending if t.is_alive()] + [thread]


@atexit.register
def _join_ending() -> None:
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    with _ending_lock:
        ending = list(_ending)
    for thread in ending:
        if thread.ident is not None:  # started
            thread.join(max(0.0, deadline - time.monotonic()))


_shared: _Queue | None = None
_shared_lock = threading.Lock()


def single_queue() -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1: every stream of the device on one hardware queue."""
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"


class Stream:
    """One communicator stream (collectives, or p2p with one peer)."""

    def __init__(self, name: str):
        global _shared
        if single_queue():
            with _shared_lock:
                if _shared is None:
                    _shared = _Queue(f"{WORKER_PREFIX}queue")
            self._queue = _shared
        else:
            self._queue = _Queue(f"{WORKER_PREFIX}{name}")

    def enqueue(self, op: DeviceOp) -> None:
        self._queue.put(op)

    def close(self) -> None:
        """The communicator is gone: its worker ends after what is queued (the shared queue of
        the single-queue mode serves every communicator and stays)."""
        if self._queue is not _shared:
            self._queue.put(None)
            end_before_exit(self._queue.thread)


class DriverLock:
    """The CUDA driver's context lock, as far as an H200 showed it: a thread inside
    cudaStreamSynchronize holds it, and cudaEventDestroy on any other thread waits for it until
    that synchronize returns. (That rank's training thread waited in a host read for a
    collective stuck on a stopped peer; its epoch watcher, about to abort that collective,
    first let go of an event and waited here: neither ever went on.) Not modelled, because not
    seen: which other driver calls wait the same way."""

    def __init__(self):
        self._cond = threading.Condition()
        self._syncing: dict[int, int] = {}  # thread id -> synchronizes in progress

    @contextmanager
    def synchronizing(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._syncing[me] = self._syncing.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._syncing[me] -= 1
                if not self._syncing[me]:
                    del self._syncing[me]
                self._cond.notify_all()

    def destroy_event(self) -> None:
        """Blocks while another thread synchronizes (unbounded, as the driver's lock). Not on the
        emulation's own threads, which stand for the device and NCCL's internals, not the host:
        its stream workers, and gloo's C++ threads running its completion callbacks (Python's
        garbage collector ran there and freed a work's event: that thread, waiting, kept every
        later operation of its communicator from completing, on one member only)."""
        thread = threading.current_thread()
        if isinstance(thread, threading._DummyThread) or thread.name.startswith(WORKER_PREFIX) \
                or getattr(_local, "collecting", False):  # nor the garbage collector's frees:
            return  # cycles of the emulation's own objects, freed under any lock of any thread
        me = threading.get_ident()
        with self._cond:
            self._cond.wait_for(lambda: not set(self._syncing) - {me})

    def synchronizing_threads(self) -> int:
        with self._cond:
            return len(self._syncing)


DRIVER = DriverLock()  # the process's


def driver() -> DriverLock:
    """The calling thread's driver lock: the process's, unless `own_driver()` gave it one."""
    return getattr(_local, "driver", None) or DRIVER


def own_driver() -> None:
    """The calling thread stands for a process of its own (a rank, in a test that runs ranks as
    threads): its reads hold, and its events wait for, a driver lock no other rank shares."""
    _local.driver = DriverLock()


class Event:
    """A CUDA event recorded on a compute stream: `query()` is True once the stream passed the
    point it was recorded at; its destruction (the last reference let go) takes the driver's
    lock, as cudaEventDestroy does."""

    __slots__ = ("_marks", "_driver")

    def __init__(self, marks: list[DeviceOp]):
        self._marks, self._driver = marks, driver()  # the context it was created in

    def query(self) -> bool:
        return all(op.finished.is_set() for op in self._marks)

    def __del__(self) -> None:
        if DRIVER is not None:  # None at interpreter shutdown
            self._driver.destroy_event()


class ComputeStream:
    """The calling thread's current stream: operations the host queued on it and did not wait for."""

    def __init__(self):
        self.pending: list[DeviceOp] = []
        self.host_reads = 0

    def add(self, op: DeviceOp) -> None:
        self.pending.append(op)

    def snapshot(self) -> list[DeviceOp]:
        """What an operation queued now runs after; finished ones are dropped on the way."""
        self.pending = [op for op in self.pending if not op.finished.is_set()]
        return list(self.pending)

    def event(self) -> Event:
        """A CUDA event recorded now."""
        return Event(self.snapshot())

    def synchronize(self) -> None:
        """Block the host until the stream has passed everything queued on it (unbounded, as
        cudaStreamSynchronize: only an abort of the stuck communicator ends the wait), holding
        the driver's lock while it waits."""
        if not self.snapshot():
            return
        with driver().synchronizing():
            while self.pending:
                self.pending[0].finished.wait()
                self.pending.pop(0)


_local = threading.local()


def _note_collection(phase: str, info: dict) -> None:
    _local.collecting = phase == "start"


gc.callbacks.append(_note_collection)


def current() -> ComputeStream:
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = ComputeStream()
    return stream
