"""One emulated NCCL communicator: gloo carries the data, NCCL's rules decide when it is done.

What it keeps of NCCL and of torch >= 2.8's ProcessGroupNCCL (what ReCoVer depends on):
  * creating the communicator is collective and blocks until every member arrived; the unique
    id goes through the store (member 0 publishes it, the others fetch it);
  * operations are queued on the communicator's streams (one for collectives, one per p2p peer)
    and return at once; a synchronous collective (`asyncOp` False) goes on the caller's current
    stream and returns no work; `work.wait()` makes the current stream wait, never the host;
  * an operation finishes only when every member posted its side. p2p is matched by posting
    order, with no tags: the k-th send from s to d meets the k-th receive at d from s, as one
    all-reduce on a two-member gloo group of that direction (the receiver adds zeros), so a send
    also waits for its receiver. When the transport fails (a member died) the operation does not
    fail: it never finishes, and its stream is stuck, until the communicator is aborted;
  * `abort()` fails every pending operation and releases whatever waits on it;
  * a work's outcome is `get_future_result()`, WorkResult's integer, readable a moment after it
    finished; `get_error()` is the communicator's error state.
What it does not model: NVLink/NVLS or IB timing, memory, kernels competing for SMs.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from enum import Enum
from typing import Any

import torch.distributed as dist

from recover_patches.collectives.emulated_nccl import streams
from recover_patches.collectives.emulated_nccl.streams import DeviceOp

logger = logging.getLogger(__name__)
# seconds the process's first connect takes (NCCL's init across hundreds of members: tests of
# start-up's bound use it); once per process
FIRST_CONNECT_ENV = "RECOVER_EMULATE_NCCL_FIRST_CONNECT_SECONDS"
_first_connect = threading.Lock()
# How a lost member shows (docs/NCCL.md 8.1): "silent" (default; IB, NVLink): its operations
# just never finish; "socket" (NCCL over sockets, as on the shared-GPU harness): they also read
# as failed at once, with REMOTE_ERROR, while the stream behind them stays stuck until the abort
TRANSPORT_ENV = "RECOVER_EMULATE_NCCL_TRANSPORT"
INIT_TIMEOUT = timedelta(seconds=60)  # = TORCH_NCCL_NONBLOCKING_TIMEOUT under ReCoVer
FOREVER = timedelta(days=1)  # an NCCL operation has no timeout of its own
SUCCESS, COMM_ERROR = 0, 2  # WorkResult's integers, as ProcessGroupNCCL's future holds them


class ErrorType(Enum):  # c10d's ErrorType, what ProcessGroupNCCL.get_error() returns
    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    REMOTE_ERROR = 3


Gloo = Any  # dist.ProcessGroupGloo: its stub lacks the collectives the binding has
Step = Callable[[Gloo], dist.Work]  # the transport call, started on the worker


class ResultFuture:
    """`get_future_result()`: WorkResult's integer, published a moment after the op finished."""

    def __init__(self, op: DeviceOp):
        self._op = op

    def done(self) -> bool:
        return self._op.published() or self._op.remote_error is not None

    def value(self) -> int:
        op = self._op
        return SUCCESS if op.failure is None and op.remote_error is None else COMM_ERROR


def _memory(tensors) -> list:
    """The tensors' memory: shared storage, a version counter and autograd state of its own."""
    return [t.data for t in tensors]


class EmulatedWork:
    """The work of an asynchronous operation. It holds a CUDA event, as WorkNCCL's future does:
    letting go of the last reference destroys it, under the driver's lock (`streams.Event`)."""

    def __init__(self, op: DeviceOp):
        self._op = op
        self._future_event = streams.Event([op])

    def is_completed(self) -> bool:  # WorkNCCL's: its kernel ended, or its communicator failed
        return self._op.finished.is_set() or self._op.remote_error is not None

    def get_future_result(self) -> ResultFuture:
        return ResultFuture(self._op)

    def exception(self):
        error = self._op.failure or self._op.remote_error
        return None if error is None else RuntimeError(error)

    def wait(self, timeout=None) -> bool:
        """The current stream waits for it; the host goes on."""
        streams.current().add(self._op)
        return True


class EmulatedCommunicator:
    def __init__(self, store, rank: int, size: int, unique_id: str | None = None):
        self._store, self.group_rank, self._size = store, rank, size
        self._unique_id = unique_id  # a shrunk communicator's is its parent's, extended
        self._gloo: Gloo | None = None
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        self._error = ErrorType.SUCCESS
        self._pending: set[DeviceOp] = set()
        self._streams: dict[int | None, streams.Stream] = {}
        self._pairs: dict[tuple[int, int], Gloo] = {}  # p2p, one per direction
        self.extra_communicators = 0  # made by an eager connect of a connected backend
        self._reports_remote_errors = os.environ.get(TRANSPORT_ENV, "silent") == "socket"

    # --- what ReCoVer's layer 1 asks of a backend ----------------------------------------
    supports_shrinking = True  # ncclCommShrink (NCCL >= 2.27)

    def name(self) -> str:
        return "nccl"

    def size(self) -> int:
        return self._size

    def get_error(self) -> ErrorType:
        return self._error

    def eager_connect_single_device(self, device=None) -> None:
        """As torch 2.13's: a communicator of its own every time. A shrunk backend already holds
        one (ncclCommShrink made it), so this makes a second, with a unique id exchanged under the
        parent's store key -- where a member may read the parent's stale id -- and drops it."""
        if self._gloo is None:
            self._connect()
            return
        self.extra_communicators += 1
        if self.group_rank == 0:
            self._store.set("unique_id", uuid.uuid4().hex)
        stale_or_new = self._store.get("unique_id").decode()
        dist.ProcessGroupGloo(dist.PrefixStore(f"emulated-nccl/{stale_or_new}/", self._store),
                              self.group_rank, self._size, INIT_TIMEOUT)

    def abort(self) -> None:
        """Every pending operation fails; whatever waits on one is released."""
        self._aborted.set()
        self._error = ErrorType.COMM_ERROR
        with self._lock:
            pending, self._pending = list(self._pending), set()
            workers = list(self._streams.values())
            transports = [g for g in (self._gloo, *self._pairs.values()) if g is not None]
            self._gloo, self._pairs = None, {}
        for op in pending:
            op.finish("communicator aborted")
        for stream in workers:
            stream.close()
        _drop_in_background(transports)

    def shrink(self, excluded: list[int], flags: int, options) -> "EmulatedCommunicator":
        """A connected communicator of the members not `excluded` (collective among them, as
        ncclCommShrink; no unique id); the parent's pending operations are aborted
        (NCCL_SHRINK_ABORT)."""
        self._connect()
        self.abort()
        rank = self.group_rank - sum(e < self.group_rank for e in excluded)
        child = EmulatedCommunicator(self._store, rank, self._size - len(excluded),
                                     f"{self._unique_id}/without-{'-'.join(map(str, excluded))}")
        child._connect()
        return child

    # --- operations ----------------------------------------------------------------------
    # Each hands gloo the tensors' memory (`_memory`, taken on the stream's worker: on the host
    # it is a read that waits for the stream), never the tensors: NCCL's kernels write memory
    # and bump no autograd version counter, where gloo's in-place copies into the tensors would
    # (autograd then refuses a custom Function's output, an all-gather's, changed after return).
    def allreduce(self, tensors, opts=None):
        return self._collective("allreduce", opts, lambda g: g.allreduce(_memory(tensors), opts)
                                if opts is not None else g.allreduce(_memory(tensors)))

    def allgather(self, output_lists, inputs, opts=None):
        return self._collective("allgather", opts, lambda g: g.allgather(
            [_memory(out) for out in output_lists], _memory(inputs), opts))

    def _allgather_base(self, output, input, opts=None):
        return self._collective("allgather", opts, lambda g: g._allgather_base(
            output.data, input.data, opts))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._collective("reduce_scatter", opts, lambda g: g._reduce_scatter_base(
            output.data, input.data, opts))

    def alltoall_base(self, output, input, out_splits, in_splits, opts=None):
        return self._collective("alltoall", opts, lambda g: g.alltoall_base(
            output.data, input.data, out_splits, in_splits, opts))

    def broadcast(self, tensors, opts=None):
        return self._collective("broadcast", opts, lambda g: g.broadcast(_memory(tensors), opts))

    def barrier(self, opts=None):
        return self._collective("barrier", opts, lambda g: g.barrier(opts))

    def send(self, tensors, dst: int, tag: int = 0):
        """Posted now; done once the receiver posted its side and the data went (no tags)."""
        outgoing = tensors[0]
        return self._post(f"send to {dst}", dst, lambda g: self._pair(self.group_rank, dst)
                          .allreduce([outgoing.clone()]), sync=False)

    def recv(self, tensors, src: int, tag: int = 0):
        incoming = tensors[0]

        def start(g):
            landing = incoming.data  # NCCL writes the memory (see the operations' comment)
            landing.zero_()
            return self._pair(src, self.group_rank).allreduce([landing])
        return self._post(f"recv from {src}", src, start, sync=False)

    # --- internals -----------------------------------------------------------------------
    def _collective(self, label: str, opts, step: Step):
        sync = opts is not None and not getattr(opts, "asyncOp", True)
        return self._post(label, None, step, sync)

    def _post(self, label: str, peer: int | None, start: Step, sync: bool):
        if self._aborted.is_set():
            raise RuntimeError(f"NCCL communicator was aborted ({label})")
        compute = streams.current()
        op = DeviceOp(label, lambda op: self._execute(op, start), compute.snapshot())
        with self._lock:
            self._pending = {p for p in self._pending if not p.finished.is_set()}
            self._pending.add(op)
            stream = self._streams.get(peer)
            if stream is None:
                stream = self._streams[peer] = streams.Stream(f"r{self.group_rank}-{peer}")
        stream.enqueue(op)
        if sync:  # torch >= 2.8: on the current stream, no work
            compute.add(op)
            return None
        return EmulatedWork(op)

    def _execute(self, op: DeviceOp, start: Step) -> None:
        """On the stream's worker: the transport call; a failed one leaves the stream stuck
        until the abort (a member is gone: the kernel never ends)."""
        try:
            transport = self._connect()
        except Exception:  # noqa: BLE001 -- a member never came: stuck
            return self._stuck(op, "the connect failed")
        try:
            work = start(transport)
        except Exception:  # noqa: BLE001 -- gloo refused the call itself: say so, loudly
            logger.warning(f"{op.label}: gloo refused the call (an argument NCCL would refuse at "
                           "the call, or a gap in the emulation); stuck until the abort",
                           exc_info=True)
            return self._stuck(op, None)
        try:
            if not self._wait(op, work):
                return  # aborted meanwhile
        except Exception:  # noqa: BLE001 -- a transport error is a member gone: stuck
            if self._reports_remote_errors:  # at once, the kernel still stuck (`DeviceOp.report`)
                self._error = ErrorType.REMOTE_ERROR
                op.report("NCCL error: remote process exited or there was a network error")
            return self._stuck(op, "the transport failed")
        op.finish()

    @staticmethod
    def _wait(op: DeviceOp, work) -> bool:
        """Until `work` ends (raises if its transport failed); False if `op` was aborted first."""
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's reduce_scatter_tensor has none: its wait blocks here
            work.wait()
            return not op.finished.is_set()
        wake = op.wake  # only the event: a callback holding the communicator could free its
        future.add_done_callback(lambda _f: wake.set())  # gloo on gloo's own thread
        op.wake.wait()
        if op.finished.is_set():
            return False
        future.wait()
        return True

    def _stuck(self, op: DeviceOp, why: str | None) -> None:
        if why is not None:
            logger.debug(f"{op.label}: {why}; stuck until the abort", exc_info=True)
        self._aborted.wait()
        op.finish("communicator aborted")

    def _pair(self, src: int, dst: int) -> Gloo:
        """The two-member gloo group of p2p from `src` to `dst`, made at its first use by both
        (on the stream's worker: as NCCL's lazy p2p communicator, it waits for the peer)."""
        key = (src, dst)
        if key not in self._pairs:
            store = dist.PrefixStore(f"emulated-nccl/{self._exchange_id()}/p2p/{src}-{dst}/",
                                     self._store)
            pair = dist.ProcessGroupGloo(store, int(self.group_rank == dst), 2, INIT_TIMEOUT)
            pair.set_timeout(FOREVER)
            self._pairs[key] = pair
        return self._pairs[key]

    def _connect(self) -> Gloo:
        """Collective: blocks until every member arrived (NCCL's init), once."""
        with self._lock:
            if self._gloo is not None:
                return self._gloo
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        _slow_first_connect()
        unique_id = self._exchange_id()
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"emulated-nccl/{unique_id}/", self._store),
                                     self.group_rank, self._size, INIT_TIMEOUT)
        gloo.set_timeout(FOREVER)
        with self._lock:
            if self._gloo is None:
                self._gloo = gloo
            return gloo if self._gloo is None else self._gloo

    def _exchange_id(self) -> str:
        if self._unique_id is None:
            if self.group_rank == 0:
                self._store.set("unique_id", uuid.uuid4().hex)
            self._unique_id = self._store.get("unique_id").decode()
        return self._unique_id


def _slow_first_connect() -> None:
    if _first_connect.acquire(blocking=False):  # never released: the first connect only
        time.sleep(float(os.environ.get(FIRST_CONNECT_ENV, "0")))


def _drop_in_background(transports: list) -> None:
    """gloo's destructor waits for its operations in flight -- here, for one whose peer never
    posts, until that peer's side closes: never on the thread that aborted (it releases the
    GIL). The process's exit waits a little for it (`streams.end_before_exit`)."""
    box = list(transports)
    transports.clear()
    thread = threading.Thread(target=box.clear, name="emulated-nccl-drop", daemon=True)
    streams.end_before_exit(thread)
    thread.start()
