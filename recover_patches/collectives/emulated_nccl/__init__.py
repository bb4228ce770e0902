"""An emulated NCCL for CPU runs: gloo carries the data, NCCL's and torch's ProcessGroupNCCL's
rules decide when an operation is done and when the host blocks (`communicator.py`,
`streams.py`, `host_reads.py`; docs/NCCL.md §8).

One switch, `RECOVER_EMULATE_NCCL=1`, read by the launcher and the entry point: ReCoVer's groups
then use the backend kind `nccl-emulated` instead of gloo, and the training thread's host reads
wait for its compute stream, so every multi-process test, bench or demo can run under it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

ENV_VAR = "RECOVER_EMULATE_NCCL"
KIND = "nccl-emulated"


def requested(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def install(host_thread: bool = True) -> str:
    """Register the backend kind (idempotent) and, with `host_thread`, apply the host-read rules
    to the calling thread. Returns the kind's name."""
    from recover_patches.collectives import backends, device_events
    from recover_patches.collectives.emulated_nccl import host_reads, streams
    from recover_patches.collectives.emulated_nccl.communicator import EmulatedCommunicator

    def make(store, rank, size, build_timeout, op_timeout):
        return EmulatedCommunicator(store, rank, size)
    def probe():  # as the NCCL kind's: destroyed on the recording thread
        return device_events.recorded(lambda: streams.current().event())
    backends.KINDS[KIND] = backends.Kind(
        make, host_waits=False, ready_probe=probe,
        stream_work=lambda: backends.StreamOrderedWork(probe()))
    if host_thread:
        host_reads.enter()
    return KIND


def installed() -> bool:
    from recover_patches.collectives import backends
    return KIND in backends.KINDS


def host_reads_so_far() -> int:
    """Host reads the calling thread made (0 unless the rules were applied to it)."""
    from recover_patches.collectives.emulated_nccl import host_reads
    return host_reads.counted()
