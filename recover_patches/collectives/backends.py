"""Building, connecting, shrinking and discarding the real backend inside a ResilientProcessGroup.

gloo (CPU, measured here): construction with a long timeout (it is the rendezvous), then the
operation timeout via `set_timeout`, which really cancels a stuck operation. gloo has no working
abort: dropping the last reference closes its sockets (peers then fail in ~20 ms), but the
destructor waits for in-flight work up to the timeout, so it runs on a background thread.

NCCL (GPU; see design.md §13 for what torch 2.13 does on its own): the rank's environment was set
by `nccl_env` before any group existed. A backend is connected *inside* the rebuild's bounds:
non-blocking init, the NCCL unique id fetched from a store client whose timeout is the operation
timeout, the communicator created eagerly and proven by a one-element all-reduce, all on a helper
thread the rebuild stops waiting for at that deadline. Otherwise a member that died before first use
would surface mid-phase, as a wait of up to 30 minutes inside torch. A DP group whose member died
is shrunk (`ncclCommShrink` with NCCL_SHRINK_ABORT) rather than re-created where the backend can.

Kinds are registered by name (`KINDS`), so tests can add a fake asynchronous backend that
behaves like NCCL (works complete later, errors arrive on completion) without a GPU.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from recover_patches.collectives import device_events, nccl_env
from recover_patches.collectives.watchdog import PENDING, result_of

SHRINK_ABORT = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)


@dataclass(frozen=True)
class Kind:
    """How one backend kind is made and watched."""
    # (store, rank, size, build timeout, op timeout) -> an unconnected backend
    make: Callable[..., object]
    host_waits: bool  # wait() blocks the host (gloo); else a stream wait the watchdog bounds
    device: Callable[[], torch.device] = lambda: torch.device("cpu")
    # a probe per operation: its inputs are ready (a CUDA event on the compute stream)
    ready_probe: Callable[[], Callable[[], bool] | None] = lambda: None
    # what watches an operation the backend ran in stream order and returned no work for
    stream_work: Callable[[], "StreamOrderedWork"] = lambda: StreamOrderedWork(lambda: True)


class _Succeeded:
    """A published WorkResult of SUCCESS (the backend's own error state is read beside it)."""

    def done(self) -> bool:
        return True

    def value(self) -> int:
        return 0


class StreamOrderedWork:
    """The work of an operation a backend ran in stream order and returned none for: torch >= 2.8's
    NCCL does that for a synchronous collective (`async_op=False`, megatron-core's tensor-parallel
    all-reduces): the kernel runs on the current stream, so there is nothing to wait for. Taking
    that None for a broken group stopped every TP > 1 job on an H200. Completion is an event
    recorded on the stream right after the operation; the watchdog bounds it like any work."""

    def __init__(self, done: Callable[[], bool]):
        self._done = done

    def is_completed(self) -> bool:
        return self._done()

    def get_future_result(self) -> _Succeeded:
        return _Succeeded()

    def exception(self) -> None:
        return None

    def wait(self, timeout=None) -> bool:
        return True  # already ordered before whatever the stream runs next


def _make_gloo(store, rank: int, size: int, build_timeout: float, op_timeout: float):
    backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=build_timeout))
    backend.set_timeout(timedelta(seconds=op_timeout))  # the real cancellation on gloo
    return backend


def _make_nccl(store, rank: int, size: int, build_timeout: float, op_timeout: float):
    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    nccl_env.check_applied()
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = 0  # non-blocking init: waitReady is bounded by the env's timeout
    # torch's C++ watchdog must never act first: ReCoVer's watchdog aborts at op_timeout
    options._timeout = timedelta(seconds=nccl_env.cpp_timeout(op_timeout))
    return dist.ProcessGroupNCCL(store, rank, size, options)


class SharedClientView(dist.Store):
    """The rank's one store client, as an asynchronous backend's set-up sees it (NCCL's
    unique-id exchange; the emulated NCCL's pair groups): its blocking reads poll `check` until
    the key is there, within `timeout` (the rebuild's T; torch sets no bound of its own).

    A client of its own per group would hold a connection to the coordinator for the group's
    lifetime (torch keeps a backend's store): connections growing with ranks x groups. Sharing
    the rank's client instead, a blocking `get` would hold its lock while it waits, and groups
    connect concurrently: one group's wait for its id would block another group's root from
    publishing its own, on every rank at once, until the timeout. Polling holds the lock only
    for each short request."""

    POLL = 0.005  # seconds between checks: set-up only, never in an iteration

    def __init__(self, client: dist.Store, timeout: float):
        super().__init__()
        self._client, self._timeout = client, timeout

    def _wait_for(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout if timeout is None else min(self._timeout,
                                                          timeout.total_seconds())
        deadline = time.monotonic() + limit
        while not self._client.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out after {limit:g} s waiting for {keys}")
            time.sleep(self.POLL)

    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self._client.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def set(self, key: str, value) -> None:
        self._client.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._client.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._client.check(keys)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._client.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(key)

    def num_keys(self) -> int:
        return self._client.num_keys()


_views: dict[tuple[int, float], SharedClientView] = {}  # (a view holds its client: ids stay)
_views_lock = threading.Lock()


def shared_view(client: dist.Store, timeout: float) -> SharedClientView:
    """One view per client and timeout, kept for the process's lifetime: a PrefixStore (and the
    backend) keeps only the C++ side of a Python store, whose methods then fail once the Python
    object is collected. (The client is the rank's own, long-lived anyway.)"""
    with _views_lock:
        key = (id(client), timeout)
        if key not in _views:
            _views[key] = SharedClientView(client, timeout)
        return _views[key]


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


def _cuda_ready_probe() -> Callable[[], bool]:
    """The watchdog lets go of it: destroyed on this thread (`device_events`)."""
    return device_events.recorded(_cuda_event)


KINDS: dict[str, Kind] = {
    "gloo": Kind(_make_gloo, host_waits=True),
    "nccl": Kind(_make_nccl, host_waits=False,
                 device=lambda: torch.device("cuda", torch.cuda.current_device()),
                 ready_probe=_cuda_ready_probe,
                 stream_work=lambda: StreamOrderedWork(_cuda_ready_probe())),
}


def kind_of(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"backend {name!r} is not supported: use 'gloo' (CPU) or 'nccl' (GPU)")
    return KINDS[name]


def build(kind: str, store, prefix: str, rank: int, size: int, build_timeout: float,
          op_timeout: float):
    """A connected backend under `prefix` of `store`, or RuntimeError. gloo's construction is its
    own rendezvous, bounded by `build_timeout`. An asynchronous backend is built after its
    members met (`rendezvous`): connecting is the only wait left, bounded like any operation by
    `op_timeout` (--recover-timeout), the store's reads and the eager connect alike, on the
    rank's one store client (`SharedClientView`)."""
    spec = kind_of(kind)
    if spec.host_waits:
        return spec.make(dist.PrefixStore(prefix, store), rank, size, build_timeout, op_timeout)
    client = dist.PrefixStore(prefix, shared_view(store, op_timeout))
    backend = spec.make(client, rank, size, build_timeout, op_timeout)
    connect_within(backend, spec.device(), op_timeout)
    return backend


def shrink(kind: str, parent, excluded: Sequence[int], timeout: float):
    """A smaller communicator from `parent` without its `excluded` (group-local) ranks, proven
    within `timeout`; the parent's pending operations are aborted (NCCL_SHRINK_ABORT).
    RuntimeError on failure."""
    spec = kind_of(kind)
    box: list = []

    def run() -> None:
        box.append(parent.shrink(sorted(excluded), SHRINK_ABORT, None))
    _within(run, timeout, "shrink")
    # Proven, not connected: the shrunk backend holds ncclCommShrink's communicator, and torch
    # 2.13's eager connect would init a second one (its unique id under the parent's store key,
    # where a member may read the parent's stale id) and leak it (read in its source, emulated)
    connect_within(box[0], spec.device(), timeout, eager=False)
    return box[0]


def can_shrink(backend) -> bool:
    return bool(getattr(backend, "supports_shrinking", False))


def connect_within(backend, device: torch.device, timeout: float, eager: bool = True) -> None:
    """Create the communicator now (`eager`) and prove it with a one-element all-reduce, all
    within `timeout`; else abort the backend (in the background) and raise RuntimeError."""
    def run() -> None:
        if eager and hasattr(backend, "eager_connect_single_device"):
            backend.eager_connect_single_device(device)
        work = backend.allreduce([torch.ones(1, device=device)])
        while not work.is_completed():
            time.sleep(0.001)
        while (error := result_of(work, backend)) is PENDING:
            time.sleep(0.001)
        if error is not None:
            raise RuntimeError(f"warm-up all-reduce failed: {error}")
    try:
        _within(run, timeout, "connect")
    except RuntimeError:
        discard(backend, [])
        raise


def _within(action: Callable[[], None], timeout: float, what: str) -> None:
    """Run `action` on a helper thread; stop waiting for it after `timeout` s. A thread left
    behind is stuck inside torch (e.g. waitReady) until the backend's abort or its own bound."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            errors.append(e)
    thread = threading.Thread(target=run, name=f"recover-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RuntimeError(f"{what} did not finish within {timeout:g}s (a member is gone)")
    if errors:
        raise RuntimeError(f"{what} failed: {errors[0]}") from errors[0]


_drops: list[threading.Thread] = []
_drops_lock = threading.Lock()


def discard(backend, works: list) -> None:
    """Drop `backend` (and the works that keep it alive) without blocking the caller: abort a
    communicator that has one (NCCL), drop the last references (gloo closes its sockets)."""
    box = [backend, *works]
    del backend, works

    def drop() -> None:
        if box and box[0].name() != "gloo" and hasattr(box[0], "abort"):
            box[0].abort()
        box.clear()  # the last references: gloo's destructor may block up to its timeout here

    thread = threading.Thread(target=drop, name="recover-discard-backend", daemon=True)
    with _drops_lock:  # started under the lock: join_discards never sees an unstarted thread
        _drops[:] = [t for t in _drops if t.is_alive()]
        thread.start()
        _drops.append(thread)


def join_discards(timeout: float) -> bool:
    """Wait up to `timeout` s for background discards to finish (tests, clean shutdown).
    True if none is left running."""
    deadline = time.monotonic() + timeout
    with _drops_lock:
        threads = list(_drops)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
