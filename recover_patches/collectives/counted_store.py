"""A rank's connections to the coordinator's store, counting every operation made through them.

The coordinator serves every rank of the job from one store, so what one rank costs it per
iteration is the design's scaling figure: the iteration record's `store_ops` is read from here.
The membership client opens its three connections (its own, the watcher's and the heartbeat's)
over one `OpCounter`; the commit vote, the recovery barriers and the groups'
rendezvous all go through the client's connection, so nothing a rank asks of the coordinator's
store escapes the count -- except a backend's own connection set-up, which C++ makes on the
`native` store (gloo's or NCCL's address exchange, only when a group is built or rebuilt).

The main thread's connection is also bounded: over a cut link a TCPStore client's `add`,
`check` and `compare_set` wait for TCP's own give-up (`bounded_call.py`), so each operation that
waits for an answer runs under a `BoundedCaller` and, past its limit, fails as a lost connection
does (`DistNetworkError`): the callers that survive a coordinator's loss then wait for the
reconnection to its successor and retry. Blocking `wait` and `queue_pop` keep their own timeouts.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from recover_patches.collectives.bounded_call import BoundedCaller, OperationTimedOut

T = TypeVar("T")


class OpCounter:
    """Operations so far, from any thread (the heartbeat and the watcher have their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def tick(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count


class CountedStore:
    """The operations ranks make on the coordinator's store, each counted once when it is made
    (a blocking pop counts when it starts, however long it then waits)."""

    def __init__(self, native: dist.Store, counter: OpCounter, bound: BoundedCaller | None = None):
        self.native = native  # for backends, which need a real store (not counted)
        self._counter = counter
        self._bound = bound

    def _answered(self, op: Callable[[], T]) -> T:
        """An operation that waits for the store's answer: within the bound, if there is one."""
        if self._bound is None:
            return op()
        try:
            return self._bound(op)
        except OperationTimedOut as e:
            raise dist.DistNetworkError(f"the coordinator's store did not answer: {e}") from None

    def set(self, key: str, value: str) -> None:
        self._counter.tick()
        self._answered(lambda: self.native.set(key, value))  # (waits for the client's lock)

    def append(self, key: str, value: str) -> None:
        self._counter.tick()
        self._answered(lambda: self.native.append(key, value))  # type: ignore[attr-defined]
        # (torch's stub lacks Store.append, which TCPStore and PrefixStore have)

    def get(self, key: str) -> bytes:
        self._counter.tick()
        return self._answered(lambda: self.native.get(key))

    def add(self, key: str, amount: int) -> int:
        self._counter.tick()
        return self._answered(lambda: self.native.add(key, amount))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._counter.tick()
        return self._answered(lambda: self.native.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        self._counter.tick()
        return self._answered(lambda: self.native.check(keys))

    def delete_key(self, key: str) -> bool:
        self._counter.tick()
        return self._answered(lambda: self.native.delete_key(key))

    def answer_within(self, seconds: float, timed: dist.Store) -> None:
        """Answers are waited for up to `seconds` from now on, by the bound and by `timed`, the
        client whose own timeout ends a `get`'s wait (a PrefixStore passes its calls on to it)."""
        if self._bound is not None:
            self._bound.set_limit(seconds)
        timed.set_timeout(timedelta(seconds=seconds))

    def close(self) -> None:
        """Ends the bound's worker (the connection itself closes with its last reference)."""
        if self._bound is not None:
            self._bound.close()

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._counter.tick()
        self.native.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._counter.tick()
        return self._answered(lambda: self.native.multi_get(keys))

    def queue_push(self, key: str, value: str) -> None:
        self._counter.tick()
        self.native.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self._counter.tick()
        return self.native.queue_pop(key, block)
