"""Members that gave up on a backend say so in the store, for the members still waiting on it.

gloo needs none of this: a member that drops its backend closes its sockets and every peer
blocked on it fails within milliseconds. NCCL tells nobody: a member that aborts its side (it
left for recovery, its replica broke, an operation of its failed) leaves its peers' kernels
waiting until their own watchdog's T, while it may already be waiting for them elsewhere (a
recovery barrier bounded by the same T). So the departing member writes `<prefix>left` under
the rendezvous that built the backend (the same name on every member), and a peer's watchdog
asks for it once an operation has waited a quarter of its timeout (`watchdog.Watched.left`):
no store operation while operations complete.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def announce(store, prefix: str) -> None:
    """On a thread of its own: the caller may be the watchdog's or the epoch watcher's."""
    if not prefix:
        return  # never built

    def write() -> None:
        try:
            store.set(prefix + "left", "1")
        except Exception as e:  # noqa: BLE001 -- the coordinator away: peers time out instead
            logger.debug(f"could not announce leaving {prefix}: {e}")
    threading.Thread(target=write, name="recover-departure", daemon=True).start()


def probe(store, prefix: str) -> Callable[[], bool]:
    """Whether a member gave up on the backend the rendezvous at `prefix` built."""
    def left() -> bool:
        try:
            return bool(prefix) and store.check([prefix + "left"])
        except Exception:  # noqa: BLE001 -- unknown: the timeout still bounds the operation
            return False
    return left
