"""Small gloo jobs inside a test: `run_ranks(target, n, *args)` runs `target(rank, *args)` on n
spawned ranks of one process group and returns their errors ([] when every rank passed). Bounded
(each join waits 90 s at most, the test's own timeout ends it) and every process is killed by the
parent before it returns."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, world: int, target, args: tuple, failures) -> None:
    """One rank of a gloo job: `target(rank, *args)`; its error or its success goes to the
    parent, which asserts."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        target(rank, *args)
        # every rank done with every group before any tears its sockets down
        dist.barrier()
        failures.put(("done", rank))
        # a gloo pair closed under a peer's last message can still abort that peer in teardown
        # ("terminate called without an active exception", SIGABRT): after "done" the parent
        # does not count that against the ranks' results
        dist.destroy_process_group()
    except BaseException as error:
        failures.put(("error", f"rank {rank}: {error!r}"))
        raise


def run_ranks(target, nprocs: int, *args) -> list[str]:
    """Run `target(rank, *args)` on `nprocs` gloo ranks; their errors, every process killed. A
    process that dies after every rank reported done died in gloo's teardown, not in the test."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    failures = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_rank_main, args=(free_port(), nprocs, target, args, failures),
                                 nprocs=nprocs, join=False, start_method="spawn")
    exited: Exception | None = None
    try:
        while not context.join(timeout=90):
            pass
    except mp.ProcessRaisedException:
        pass  # its error is in the queue
    except mp.ProcessExitedException as error:  # a signal or an exit code, nothing queued
        exited = error
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    errors, done = [], set()
    while not failures.empty():
        kind, what = failures.get()
        if kind == "done":
            done.add(what)
        else:
            errors.append(what)
    if exited is not None and len(done) < nprocs:
        errors.append(f"{exited!r} before every rank was done (done: {sorted(done)})")
    return errors
