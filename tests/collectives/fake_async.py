"""A fake asynchronous backend that behaves like torch 2.13's ProcessGroupNCCL where ReCoVer
depends on it, so the NCCL path's logic runs on CPU: works complete later (the test decides
when); the outcome is published through `get_future_result()` (a Future of WorkResult's
integer, filled in a moment after completion); `exception()` is unreadable, as the NCCL binding's
was; `get_error()`, `abort()`, `eager_connect_single_device()` and `shrink()` exist. A
synchronous all-reduce (`asyncOp` False) returns no work, as torch >= 2.8's NCCL does.

`install()` registers it in `backends.KINDS` under the name "fake-nccl"; every backend it makes
is recorded in `Fabric.made`, every shrink in `Fabric.shrunk`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum

from recover_patches.collectives import backends

NAME = "fake-nccl"


class Result(Enum):  # torch's WorkResult names
    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    UNKNOWN = 100


class FakeFuture:
    def __init__(self, work: "FakeWork"):
        self._work = work

    def done(self) -> bool:
        return self._work.published.is_set()

    def value(self) -> int:  # the bare integer, as ProcessGroupNCCL's future holds it
        return self._work.result.value


class FakeWork:
    def __init__(self, complete: bool = False):
        self.completed, self.published = threading.Event(), threading.Event()
        self.result = Result.SUCCESS
        self.waited = False
        if complete:
            self.finish()

    def finish(self, result: Result = Result.SUCCESS, publish: bool = True) -> None:
        """The device ran it; torch's own watchdog publishes the outcome (unless not yet)."""
        self.result = result
        self.completed.set()
        if publish:
            self.published.set()

    def is_completed(self) -> bool:
        return self.completed.is_set()

    def get_future_result(self) -> FakeFuture:
        return FakeFuture(self)

    def exception(self):  # the NCCL binding on torch 2.11
        raise TypeError("Unable to convert function return value to a Python type!")

    def wait(self, timeout=None) -> bool:  # a stream wait: returns at once
        self.waited = True
        return True


@dataclass
class Fabric:
    """What the fake kind did, and how it should behave."""
    made: list["FakeBackend"] = field(default_factory=list)
    shrunk: list[tuple["FakeBackend", list[int]]] = field(default_factory=list)
    hang_connect: bool = False  # eager connect never returns (a member died before first use)
    shrinkable: bool = False  # supports_shrinking (NCCL >= 2.27)
    complete: bool = True  # works complete (and publish SUCCESS) as they are issued
    fetch_id: bool = False  # members > 0 fetch the unique id from the store, as NCCL's do
    connect_seconds: float = 0.0  # how long an eager connect takes (NCCL: 1-10 s across nodes)
    connecting: int = 0  # eager connects running now, and the most that ever ran at once
    most_connecting: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stream: list[FakeWork] = field(default_factory=list)  # synchronous ops, in stream order


class FakeBackend:
    def __init__(self, fabric: Fabric, rank: int, size: int):
        self.fabric, self.group_rank, self._size = fabric, rank, size
        self.works: list[FakeWork] = []
        self.aborted = threading.Event()
        self.error = Result.SUCCESS
        self.connected = False

    @property
    def supports_shrinking(self) -> bool:
        return self.fabric.shrinkable

    def name(self) -> str:
        return "nccl"

    def size(self) -> int:
        return self._size

    def eager_connect_single_device(self, device) -> None:
        if self.fabric.hang_connect:
            self.aborted.wait()  # as NCCL's waitReady: stuck until the communicator is aborted
        fabric = self.fabric
        with fabric.lock:
            fabric.connecting += 1
            fabric.most_connecting = max(fabric.most_connecting, fabric.connecting)
        time.sleep(fabric.connect_seconds)
        with fabric.lock:
            fabric.connecting -= 1
        self.connected = True

    def allreduce(self, tensors, opts=None) -> FakeWork | None:
        self.works.append(FakeWork(complete=self.fabric.complete))
        if opts is not None and not opts.asyncOp:  # torch >= 2.8: run in stream order, no work
            self.fabric.stream.append(self.works[-1])  # the stream passes it when it completes
            return None
        return self.works[-1]

    def send(self, tensors, dst: int, tag: int = 0) -> FakeWork:
        self.works.append(FakeWork(complete=self.fabric.complete))
        return self.works[-1]

    recv = send  # (tensors, src, tag): the test decides when it completes

    def get_error(self) -> Result:
        return self.error

    def abort(self) -> None:
        self.aborted.set()

    def shrink(self, excluded: list[int], flags: int, options) -> "FakeBackend":
        assert flags == backends.SHRINK_ABORT
        smaller = FakeBackend(self.fabric, self.group_rank - sum(e < self.group_rank
                                                                 for e in excluded),
                              self._size - len(excluded))
        self.fabric.shrunk.append((self, list(excluded)))
        return smaller


def install(fabric: Fabric) -> None:
    def make(store, rank, size, build_timeout, op_timeout):
        if fabric.fetch_id and rank > 0:
            store.get("unique_id")  # published by member 0 (waits up to the store's timeout)
        backend = FakeBackend(fabric, rank, size)
        fabric.made.append(backend)
        return backend
    def stream_work() -> backends.StreamOrderedWork:  # an event after the latest stream op
        latest = fabric.stream[-1]
        return backends.StreamOrderedWork(latest.is_completed)
    backends.KINDS[NAME] = backends.Kind(make, host_waits=False, stream_work=stream_work)


def uninstall() -> None:
    backends.KINDS.pop(NAME, None)
