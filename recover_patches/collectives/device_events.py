"""Device events, and the works that hold them, are destroyed on the thread that made them,
never on the watchdog's or the epoch watcher's.

cudaEventDestroy takes the CUDA driver's context lock, which a thread inside
cudaStreamSynchronize holds until its stream gets there (seen on an H200, torch 2.11, driver
580; torch's ProcessGroupNCCL keeps its own events in a cache for the same reason). The
training thread records the events that bound its collectives (a work's "inputs ready" probe,
a synchronous collective's completion) and is also the thread that waits in host reads. The
watchdog and the epoch watcher are the ones that let go of them: a finished work popped, a
backend ended. Destroyed there while the training thread waits for a collective stuck on a
dead peer, an event waits for the read, which waits for the abort that thread was about to
start: the H200's survivor hung so, with its training done. A work is the same: destroying a
WorkNCCL destroys its future's CUDA events (a (2,2,2) job's survivor, on an H200, hung so in
the epoch watcher's and the watchdog's hands while it read the reduction behind a stuck
all-reduce). So an event or a work let go of on another thread is kept, and destroyed when
the thread that made it next records an event or issues a work.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class DeviceEvent(Protocol):
    """What is read of an event (`torch.cuda.Event`, the emulated NCCL's)."""
    def query(self) -> bool: ...


class DeviceWork(Protocol):
    """What is read of a device work (torch's WorkNCCL, the emulated NCCL's)."""
    def is_completed(self) -> bool: ...

    def get_future_result(self) -> Any: ...

    def exception(self) -> Any: ...

    def wait(self) -> Any: ...


# making thread -> what other threads let go of (deque: appends and pops are atomic)
_kept: dict[int, deque[object]] = {}


class _OnItsThread:
    """Holds an object whose destruction takes the driver's lock: let go of on another thread,
    the object is kept for the thread that made this holder."""

    __slots__ = ("_held", "_owner")
    _held: Any  # an event or a work (the subclass says which)

    def __init__(self, held: object):
        self._held, self._owner = held, threading.get_ident()

    def __del__(self) -> None:
        try:
            if threading.get_ident() != self._owner:
                _kept.setdefault(self._owner, deque()).append(self._held)
        except (AttributeError, TypeError):  # interpreter shutdown: nothing left to wait for
            pass


class OwnedQuery(_OnItsThread):
    """The query of an event recorded on this thread; called as the watchdog's probes are."""

    __slots__ = ()

    def __call__(self) -> bool:
        return bool(self._held.query())


class OwnedWork(_OnItsThread):
    """A work issued on this thread, read by the watchdog and the group's other threads."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return bool(self._held.is_completed())

    def get_future_result(self) -> Any:
        return self._held.get_future_result()

    def exception(self) -> Any:
        return self._held.exception()

    def wait(self) -> Any:
        return self._held.wait()


def _destroy_kept() -> None:
    """Destroy, here, what other threads let go of that this thread made."""
    kept = _kept.get(threading.get_ident())
    while kept:
        kept.popleft()


def recorded(record: Callable[[], DeviceEvent]) -> Callable[[], bool]:
    """The query of the event `record()` records now on this thread's current stream. What
    other threads let go of that this thread made is destroyed first, here."""
    _destroy_kept()
    return OwnedQuery(record())


def owned(work: DeviceWork) -> OwnedWork:
    """`work`, issued now on this thread, held so that it is destroyed on this thread."""
    _destroy_kept()
    return OwnedWork(work)


def kept_elsewhere() -> int:
    """Events and works waiting for their thread to destroy them (all threads)."""
    return sum(len(kept) for kept in list(_kept.values()))
