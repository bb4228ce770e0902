"""Admission: a node gives a process ranks only after its health check passes, and a node whose
ranks failed twice within a window gives none again.

The check runs where the ranks would (`launch --health-check`): before each replacement process
of a dead rank, and on a standby node before its processes are offered to the job. It is a
command (exit status 0: healthy), or `builtin`, the default: the device is visible, a small
matrix product on it matches the host's, and a one-process all-reduce over the device's backend
(NCCL on a GPU, gloo on the CPU) returns what it should -- the checks NVIDIA's resiliency extension
makes before its rendezvous, in the same spirit. `off` admits without a check. A failed check
starts nothing: the rank's exit is reported without a replacement, so the coordinator may give the
slot to a standby node instead.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

BUILTIN, OFF = "builtin", "off"
CHECK_TIMEOUT = 60.0  # seconds a check may take before the node counts as unhealthy


def builtin_check(local_rank: int) -> None:
    """Raise if this node's device for `local_rank` cannot compute or communicate."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if torch.cuda.is_available():
        if torch.cuda.device_count() <= local_rank:
            raise RuntimeError(f"GPU {local_rank} is not visible "
                               f"({torch.cuda.device_count()} device(s))")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    x = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64).div_(4096)
    on_device = (x.to(device) @ x.to(device)).cpu()
    if not torch.allclose(on_device, x @ x, rtol=1e-3, atol=1e-3):
        raise RuntimeError(f"a 64x64 product on {device} differs from the host's")
    # the backend itself, not torch's default group (which its caller may hold already)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group: Any = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options()) \
        if backend == "nccl" else \
        dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=CHECK_TIMEOUT))
    ones = torch.ones(8, device=device)
    group.allreduce([ones]).wait()
    if ones.sum().item() != 8:
        raise RuntimeError(f"a one-process all-reduce over {backend} returned {ones.tolist()}")


def check(command: str, local_rank: int, env: dict[str, str] | None = None,
          timeout: float = CHECK_TIMEOUT, fork: bool = False) -> str | None:
    """None if the node is healthy for `local_rank`, else why not (one line). `fork`: the
    built-in check runs in a child forked from this process (the warm launcher: torch already
    imported, no threads in a collective), else in a fresh interpreter."""
    if command == OFF:
        return None
    if command == BUILTIN and fork:
        return _forked(lambda: builtin_check(local_rank), timeout)
    if command == BUILTIN:
        command = f"{sys.executable} -m recover_patches.health {local_rank}"
    try:
        done = subprocess.run(command, shell=True, env={**os.environ, **(env or {}),
                                                        "LOCAL_RANK": str(local_rank)},
                              timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return f"health check {command!r} did not finish within {timeout:g}s"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"health check {command!r} exited {done.returncode}" + (
            f": {said[-1][:200]}" if said else "")
    return None


def _forked(body: Callable[[], None], timeout: float) -> str | None:
    """Run `body` in a forked child (the launcher's preloaded torch, no new interpreter); its
    failure's one line comes back through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(read_fd)
            body()
        except BaseException as e:  # noqa: BLE001 -- any failure is the node's
            os.write(write_fd, f"{type(e).__name__}: {e}".encode()[:500])
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return f"the built-in health check did not finish within {timeout:g}s"
        time.sleep(0.01)
    said = os.read(read_fd, 500).decode(errors="replace").strip()
    os.close(read_fd)
    code = os.waitstatus_to_exitcode(ended[1])
    if said or code != 0:  # (a crash in the driver kills the child before it can say why)
        return f"the built-in health check failed: {said or f'its process ended with {code}'}"
    return None


@dataclass
class FailureWindow:
    """This node's rank failures: `limit` of them within `window` seconds and it gets no ranks
    again (a node that keeps failing costs the job a recovery each time)."""
    window: float
    limit: int = 2
    clock: Callable[[], float] = time.monotonic
    _times: deque = field(default_factory=deque)

    def note(self) -> None:
        now = self.clock()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()

    def exhausted(self) -> bool:
        if self.window <= 0:  # off (one machine playing many nodes: tests, benchmarks)
            return False
        now = self.clock()
        return sum(1 for t in self._times if now - t <= self.window) >= self.limit


if __name__ == "__main__":  # `python -m recover_patches.health [LOCAL_RANK]`: the built-in check
    try:
        builtin_check(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    except Exception as e:  # noqa: BLE001 -- any failure is the node's
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print("healthy")
