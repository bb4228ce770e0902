"""A node cut off from the job stops its own ranks (`--rdzv-backend etcd`).

A network partition does not close connections: the cut side hears nothing and is told nothing.
The majority side declares its ranks dead after T (`--recover-timeout`) and goes on without
them; the cut side must not go on with them. A node knows it is on the majority side while
etcd's majority answers it (the leader agent's steps) or while a coordinator on another node
does (the launcher's link). When neither has answered for T, the launcher SIGKILLs its ranks
and replaces none: the node fences itself within T of the cut, plus one poll. (A coordinator on
the node itself proves nothing: it may be cut off with it; it stops when its lease lapses.)

Why both: during a fail-over the coordinator is away for seconds while etcd answers; when an
etcd member dies etcd answers late while the coordinator answers. Only a node that hears from
neither is cut off. With the static rendezvous there is no majority to lose: nothing fences.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL = 0.1  # seconds between looks at the silence


class SelfFence:
    """`silent_for()`: seconds since the job's majority side last answered this node (or any
    other silence: the watchdog's backstop uses it too); past `limit`, `fence(why(silence))`
    runs once, on this object's thread (never blocked by a cut link)."""

    def __init__(self, silent_for: Callable[[], float], limit: float,
                 fence: Callable[[str], None], why: Callable[[float], str] | None = None):
        self._silent_for, self.limit, self._fence = silent_for, limit, fence
        self._why = why or (lambda silent: (
            f"neither etcd's majority nor the coordinator answered this node for {silent:.1f}s "
            f"(--recover-timeout {limit:g}): it is cut off"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover-self-fence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            silent = self._silent_for()
            if silent > self.limit:
                self._fence(self._why(silent))
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
