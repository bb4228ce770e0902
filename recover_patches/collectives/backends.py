"""Building and discarding the real backend inside a ResilientProcessGroup.

gloo (CPU, measured here): construction with a long timeout (it is the rendezvous), then the
operation timeout via `set_timeout`, which really cancels a stuck operation. gloo has no working
abort: dropping the last reference closes its sockets (peers then fail in ~20 ms), but the
destructor waits for in-flight work up to the timeout, so it runs on a background thread.

NCCL (GPU, UNVERIFIED on this machine, from public facts: torchft / PyTorch docs): non-blocking
communicator init (`config.blocking = 0`), no watchdog tear-down of the process on errors, and
`abort()` when discarded; needs NCCL >= 2.26.2 (abort can hang in 2.25.1).
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_drops: list[threading.Thread] = []
_drops_lock = threading.Lock()


def build(kind: str, store: dist.Store, rank: int, size: int, build_timeout: float,
          op_timeout: float):
    if kind == "gloo":
        backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=build_timeout))
    elif kind == "nccl":
        backend = _build_nccl(store, rank, size, build_timeout)
    else:
        raise ValueError(f"backend {kind!r} is not supported: use 'gloo' (CPU) or 'nccl' (GPU)")
    backend.set_timeout(timedelta(seconds=op_timeout))
    return backend


def _build_nccl(store: dist.Store, rank: int, size: int, build_timeout: float):
    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    # The NCCL watchdog would otherwise kill a survivor whose peer died: we detect and abort.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = 0
    options._timeout = timedelta(seconds=build_timeout)
    return dist.ProcessGroupNCCL(store, rank, size, options)


def discard(backend, works: list) -> None:
    """Drop `backend` (and the works that keep it alive) without blocking the caller."""
    box = [backend, *works]
    del backend, works

    def drop() -> None:
        if box and hasattr(box[0], "abort") and box[0].name() == "nccl":
            box[0].abort()
        box.clear()  # the last references: gloo's destructor may block up to its timeout here

    thread = threading.Thread(target=drop, name="recover-discard-backend", daemon=True)
    with _drops_lock:
        _drops[:] = [t for t in _drops if t.is_alive()]
        _drops.append(thread)
    thread.start()


def join_discards(timeout: float) -> bool:
    """Wait up to `timeout` s for background discards to finish (tests, clean shutdown).
    True if none is left running."""
    deadline = time.monotonic() + timeout
    with _drops_lock:
        threads = list(_drops)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
