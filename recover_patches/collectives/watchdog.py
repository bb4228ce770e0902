"""One thread per process that bounds the operations whose wait() does not block the host.

On NCCL, `work.wait()` only makes the current CUDA stream wait: the host runs ahead and queues
more kernels, and a collective stuck on a dead peer would hang the stream, not the caller. So
every such work is handed to the watchdog with its deadline. The thread polls the works it holds
(`is_completed()`, an event query on CUDA) and, for a work past its deadline or one that ended
in an error, calls `on_expired` -- the group aborts its communicator (which unblocks the stuck
kernels) and latches a PeerFailure that its next operation, or the commit, raises.

gloo works are not watched: their wait() blocks the caller inside the backend, bounded by gloo's
own timeouts (collectives: `set_timeout`; p2p: the timed wait), and fails within milliseconds
when a peer's process dies or drops the group (its sockets close). An epoch that declares a
member dead is handled by the group itself (`ResilientProcessGroup._on_epoch`), not here.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class AsyncWork(Protocol):
    def is_completed(self) -> bool: ...

    def exception(self) -> Any: ...


@dataclass
class Watched:
    owner: object  # what to forget together (a group's backend generation)
    work: AsyncWork
    deadline: float
    on_expired: Callable[[str], None]  # called once, on the watchdog thread, with the reason


class Watchdog:
    """Pending works of every watched group, oldest first; `poll` seconds between sweeps while
    any is pending, none while idle."""

    def __init__(self, poll: float = 0.002, clock: Callable[[], float] = time.monotonic):
        self.poll, self.clock = poll, clock
        self._cond = threading.Condition()
        self._watched: list[Watched] = []
        self._thread: threading.Thread | None = None
        self._sweeping = threading.Lock()  # one sweep at a time: a work expires once

    def track(self, owner: object, work: AsyncWork | None, timeout: float,
              on_expired: Callable[[str], None]) -> None:
        if work is None:  # a backend that returned no work (seen from NCCL's list all-gather)
            return        # leaves nothing to watch; a watchdog thread must not die on it
        with self._cond:
            self._watched.append(Watched(owner, work, self.clock() + timeout, on_expired))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="recover-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, owner: object) -> None:
        """The owner's backend is gone (aborted, rebuilt): its works need no watching."""
        with self._cond:
            self._watched = [w for w in self._watched if w.owner is not owner]

    def pending(self) -> int:
        with self._cond:
            return len(self._watched)

    def sweep(self) -> None:
        """One pass: drop completed works, expire failed or overdue ones."""
        with self._sweeping:
            self._sweep()

    def _sweep(self) -> None:
        with self._cond:
            watched = list(self._watched)
        now, done, expired = self.clock(), [], []
        for w in watched:
            if w.work.is_completed():
                done.append(w)
                error = _error_of(w.work)
                if error is not None:
                    expired.append((w, f"backend error: {error}"))
            elif now > w.deadline:
                done.append(w)
                expired.append((w, f"no completion within the deadline "
                                   f"({now - w.deadline:.1f}s past it)"))
        if done:
            finished = {id(w) for w in done}
            with self._cond:
                self._watched = [w for w in self._watched if id(w) not in finished]
        for w, reason in expired:
            w.on_expired(reason)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._watched))
            self.sweep()
            time.sleep(self.poll)


def _error_of(work) -> object | None:
    """A completed work's backend error, or None. On torch 2.11's CUDA build (measured on an
    H100) `Work.exception()` of a NCCL work raises TypeError even after a success: its binding
    cannot return the exception_ptr. Nothing is known then; a failed NCCL collective still ends
    in ProcessGroupNCCL's own error handling, and a stuck one here as overdue."""
    try:
        return work.exception()
    except TypeError:
        return None


WATCHDOG = Watchdog()  # the process's one watchdog
