"""Store operations that give up: a TCPStore client's answers have no timeout of their own
(its `add`, `check` and `compare_set` read the reply with a plain blocking recv, and even a timed
`wait` reads its cancellation's reply that way), so over a cut link they wait until TCP itself
gives up, a quarter of an hour later. Nothing interrupts a blocked recv from Python: the caller
waits on a worker thread instead, at most `limit` seconds, and on a timeout abandons the worker
with its connection (a new worker serves the next call; the old one ends if the recv ever does).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class OperationTimedOut(RuntimeError):
    """The operation did not return within its limit (a RuntimeError, as a store's errors are)."""


class _Call:
    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.done = fn, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class BoundedCaller:
    def __init__(self, limit: float, name: str = "recover-bounded-call"):
        self.limit, self._name = limit, name
        self._calls: queue.SimpleQueue[_Call | None] | None = None

    def __call__(self, fn: Callable[[], T], limit: float | None = None) -> T:
        calls = self._calls  # (another thread may close() meanwhile: this call keeps its own)
        if calls is None:
            self._calls = calls = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(calls,), name=self._name,
                             daemon=True).start()
        call = _Call(fn)
        calls.put(call)
        wait = self.limit if limit is None else limit
        if not call.done.wait(wait):
            calls.put(None)  # the worker is abandoned: it ends if its call ever returns
            if self._calls is calls:
                self._calls = None
            raise OperationTimedOut(f"no answer within {wait:g}s (a cut link?)")
        if call.error is not None:
            raise call.error
        return call.result

    def set_limit(self, limit: float) -> None:
        """Calls from now on wait up to `limit` s (start-up's bound, then T)."""
        self.limit = limit

    def close(self) -> None:
        """End the worker (once its call, if any, returns)."""
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.put(None)

    @staticmethod
    def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
        while (call := calls.get()) is not None:
            try:
                call.result = call.fn()
            except BaseException as e:  # handed to the caller, who raises it
                call.error = e
            call.done.set()
