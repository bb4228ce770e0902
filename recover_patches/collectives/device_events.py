"""Device events are destroyed on the thread that recorded them, never on the watchdog's or the
epoch watcher's.

cudaEventDestroy takes the CUDA driver's context lock, which a thread inside
cudaStreamSynchronize holds until its stream gets there (seen on an H200, torch 2.11, driver
580; torch's ProcessGroupNCCL keeps its own events in a cache for the same reason). The
training thread records the events that bound its collectives (a work's "inputs ready" probe,
a synchronous collective's completion) and is also the thread that waits in host reads. The
watchdog and the epoch watcher are the ones that let go of them: a finished work popped, a
backend ended. Destroyed there while the training thread waits for a collective stuck on a
dead peer, an event waits for the read, which waits for the abort that thread was about to
start: the H200's survivor hung so, with its training done. So an event let go of on another
thread is kept, and destroyed when its recording thread next records one.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol


class DeviceEvent(Protocol):
    """What is read of an event (`torch.cuda.Event`, the emulated NCCL's)."""
    def query(self) -> bool: ...


# recording thread -> its events let go of on other threads (deque: appends and pops are atomic)
_kept: dict[int, deque[DeviceEvent]] = {}


class OwnedQuery:
    """The query of an event recorded on this thread; called as the watchdog's probes are."""

    __slots__ = ("_event", "_owner")

    def __init__(self, event: DeviceEvent):
        self._event, self._owner = event, threading.get_ident()

    def __call__(self) -> bool:
        return bool(self._event.query())

    def __del__(self) -> None:
        try:
            if threading.get_ident() != self._owner:
                _kept.setdefault(self._owner, deque()).append(self._event)
        except (AttributeError, TypeError):  # interpreter shutdown: nothing left to wait for
            pass


def recorded(record: Callable[[], DeviceEvent]) -> Callable[[], bool]:
    """The query of the event `record()` records now on this thread's current stream. The
    events of this thread that other threads let go of are destroyed first, here."""
    kept = _kept.get(threading.get_ident())
    while kept:
        kept.popleft()
    return OwnedQuery(record())


def kept_elsewhere() -> int:
    """Events waiting for their recording thread to destroy them (all threads)."""
    return sum(len(kept) for kept in list(_kept.values()))
