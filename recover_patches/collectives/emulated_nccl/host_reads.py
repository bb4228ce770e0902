"""Host reads wait for the device, process-wide: the compute order of a CUDA stream on the CPU.

On a GPU the host queues kernels and runs ahead; it stops only where it reads a result
(`.item()`, `.tolist()`, `float(t)`, `.numpy()`, an event's synchronize). Under the emulated NCCL
the "device" work that can be outstanding is the communicators' (compute itself runs at once on
the CPU), so two rules give the GPU's behaviour:

  * every ATen operation on a thread that reads a tensor waits until that thread's compute
    stream has passed what the host queued on it (a synchronous collective, a waited work):
    compute consumes the collective's output, as a kernel queued behind it would -- autograd's
    C++ backward included, which is why this is a dispatch mode and not only a function mode.
    Stricter than a GPU, where only the kernel waits and the host runs on: here the host waits
    at the first such operation, not at the next read (the watchdog, on its own thread, still
    bounds it);
  * the reads that go around ATen on the CPU (`tolist`, `numpy`) wait the same way.

Host reads are counted per thread (`counted()`): `_local_scalar_dense` (`item`, `float`, `bool`,
`int` of a tensor) and `tolist` / `numpy`, the synchronizing calls of a GPU run (but torch.optim's
step counters, host tensors on a GPU too). With
RECOVER_HOST_READ_SITES=FILE each process also writes, at exit, how many reads each call site
made (the first frame outside torch), rewritten at each `counted()` (the trainer's record of
an iteration: ranks end with os._exit), to find the ones a step could do without. Both modes are
entered once, on the thread that trains (`enter()`); the modes are thread-local in torch, so the
watchdog, the communicators' workers and the membership threads are never held back.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from recover_patches.collectives.emulated_nccl.streams import current

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_DIRECT_READS = {torch._C.TensorBase.tolist, torch._C.TensorBase.numpy}


class _ComputeOrder(TorchDispatchMode):
    """Every ATen operation runs after the thread's stream passed what was queued on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = current()
        if func is _SCALAR_READ:
            _count(stream)
        if stream.pending and _reads_tensors(args, kwargs):
            stream.synchronize()
        return func(*args, **(kwargs or {}))


def _reads_tensors(args, kwargs) -> bool:
    """A factory (`empty`, `ones`, ...) reads no tensor and, like its kernel on a GPU, need not
    wait; anything else might read the collective's output (conservative: any tensor)."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return True
    return False


class _DirectReads(TorchFunctionMode):
    """`tolist` and `numpy` of a CPU tensor read memory without an ATen operation."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DIRECT_READS:
            stream = current()
            _count(stream)
            if stream.pending:
                stream.synchronize()
        return func(*args, **(kwargs or {}))


_thread = threading.local()
_sites: collections.Counter[str] = collections.Counter()


def _count(stream) -> None:
    if _in_optimizer_state():
        return
    stream.host_reads += 1
    if _SITES_FILE:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and ("/torch/" in frame.f_code.co_filename
                                     or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is not None:
            _sites[f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"] += 1


def _in_optimizer_state() -> bool:
    """torch.optim's step counters live on the host on a GPU too (not capturable): their
    `.item()` is no device sync, so it is not counted."""
    frame: FrameType | None = sys._getframe(3)
    for _ in range(6):
        if frame is None:
            return False
        if "/torch/optim/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _write_sites() -> None:
    path = f"{_SITES_FILE}.{os.getpid()}"
    with open(path, "w") as f:
        json.dump(dict(_sites.most_common()), f, indent=1)


_SITES_FILE = os.environ.get("RECOVER_HOST_READ_SITES")


def enter() -> None:
    """Apply both rules on the calling thread for the rest of its life (idempotent)."""
    if getattr(_thread, "entered", False):
        return
    _ComputeOrder().__enter__()
    _DirectReads().__enter__()
    _thread.entered = True
    torch.zeros(())  # the first dispatch through a Python mode imports torch._dynamo: now


def counted() -> int:
    """Host reads made so far on the calling thread."""
    if _SITES_FILE:
        _write_sites()
    return current().host_reads
