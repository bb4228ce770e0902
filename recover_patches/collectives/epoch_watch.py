"""How a launcher learns of new membership epochs without polling the coordinator's store.

A launcher fences the ranks an epoch declares dead. It used to read the epoch key about five
times a second to find out: at 12,500 nodes, 62,500 reads a second, more than the node beats.
Now the coordinator pushes each new epoch's number onto the launcher's queue
(`notify/launcher/<node>`, as it does for every rank), and `EpochWatch` keeps one blocking pop
outstanding on a connection of its own, raising `news` when a number arrives: the launcher reads
the epoch only then. A (re)connection raises `news` too (an epoch may have been published while
it was away: a restarted coordinator learns of the launcher only from its handshake), and the
watch connects again on its own. While nothing happens it costs one store operation per `WAIT`.
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable, Iterable, Protocol

import torch.distributed as dist

from recover_patches.collectives import protocol as P

WAIT = timedelta(seconds=60)  # a blocking pop is re-issued after this
RETRY = 1.0  # seconds between connection attempts while the coordinator is away


class Queues(Protocol):
    """What the watch needs of a store connection (a TCPStore, a CountedStore)."""

    def queue_pop(self, key: str, block: bool = True) -> bytes: ...

    def queue_push(self, key: str, value: str) -> None: ...


class EpochWatch:
    """`connect(wait)`: a new connection to the job's store whose blocking operations wait up to
    `wait`. `latest`: the newest epoch number pushed to this launcher (-1: none yet). `news`:
    the launcher's, shared by the watch that replaces this one: a watch abandoned while its pop
    still waits on a live connection (the coordinator answered late, it was not gone) takes
    the next push, the queue's first waiter, and must still say so."""

    def __init__(self, connect: Callable[[timedelta], Queues], node: str,
                 news: threading.Event | None = None,
                 relay: Callable[[], Iterable[int]] = tuple):
        self._connect, self._key = connect, P.launcher_notify_key(node)
        self._relay = relay  # the ranks this launcher passes each epoch on to
        self.news = news if news is not None else threading.Event()
        self.news.set()  # nothing read yet
        self.latest = -1
        self.job_stopped = False  # the coordinator said it stopped the job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover-epoch-watch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store: Queues | None = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect(WAIT)
                    self.news.set()
                value = store.queue_pop(self._key, True).decode()
                if value == P.STOP:
                    return
                if value == P.JOB_STOPPED:
                    self.job_stopped = True
                    self.news.set()
                    continue
                for rank in sorted(self._relay()):  # first: their groups abort at once
                    store.queue_push(P.notify_key(rank), value)
                self.latest = max(self.latest, int(value))
                self.news.set()
            except dist.DistStoreError:  # WAIT passed without a new epoch: pop again
                continue
            except RuntimeError:  # the coordinator went away (or is not back yet)
                store = None
                self.news.set()
                self._stop.wait(RETRY)

    def abandon(self) -> None:
        """Stop without a word (its pop may wait on a link that was cut): the thread ends when
        that pop returns, if ever; a new watch takes over."""
        self._stop.set()

    def close(self, store: Queues) -> None:
        """End the watch: a "stop" on its queue through `store` (the launcher's connection)."""
        self._stop.set()
        try:
            store.queue_push(self._key, P.STOP)
        except RuntimeError:  # the coordinator is gone: the watch ends at its next retry
            return
        self._thread.join(5.0)
