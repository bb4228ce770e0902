"""The gradient reduction of the distributed optimizer: reduce-scatter into the ranges (and a sum
across instances) against the whole all-reduce it falls back to after a loss, side by side.

    OMP_NUM_THREADS=1 python scripts/bench/grad_reduction.py --numel 8000000 --repeats 15

Starts DP gloo ranks on this machine, each with a `GradBuffer` of --numel fp32 gradients laid out
for the distributed optimizer (one bucket padded to the instance size), and times `reduce()` --
the trainer's call, commit bookkeeping included -- alternating the modes every repetition so the
machine's load hits them alike. Prints the median ms per mode and the ratios to the all-reduce.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recover_patches.recovery.grad_buffer import GradBuffer, Scatter, flat_layout  # noqa: E402
from recover_patches.recovery.reduce import Totals  # noqa: E402


def _rank(rank: int, port: int, dp: int, numel: int, repeats: int, modes: list[int],
          results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=dp)
    scatters: dict[int, Scatter | None] = {0: None}
    for k in modes:  # K instances of S = dp / k: every rank makes every group, in one order
        size = dp // k
        instances = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(k)]
        places = [dist.new_group(list(range(j, dp, size))) for j in range(size)]
        scatters[k] = Scatter(instances[rank // size], places[rank % size], rank % size, size)
    param = torch.nn.Parameter(torch.zeros(numel))
    layout = flat_layout([param], pad_to=dp)
    buffer = GradBuffer([param], replicas=dp, dp_group=dist.group.WORLD, layout=layout)
    buffer.local[:numel].normal_()
    times: dict[int, list[float]] = {k: [] for k in scatters}
    for _ in range(repeats + 1):  # the first round warms up
        for k, scatter in scatters.items():
            buffer.scatter = scatter
            dist.barrier()
            start = time.perf_counter()
            buffer.reduce(Totals.of_ids([rank], 1, 0.0), rank, 0.0)
            times[k].append(time.perf_counter() - start)
    if rank == 0:
        results.put({k: v[1:] for k, v in times.items()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--numel", type=int, default=8_000_000, help="gradients per rank")
    p.add_argument("--instances", type=int, nargs="+", default=[1, 2],
                   help="K values to time with the reduce-scatter (each must divide --dp)")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    if any(a.dp % k for k in a.instances):
        p.error("every --instances value must divide --dp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(port, a.dp, a.numel, a.repeats, a.instances, results),
                       nprocs=a.dp, start_method="spawn")
    times = results.get()
    base = statistics.median(times[0])
    print(f"DP={a.dp} gloo ranks, {a.numel} fp32 gradients each, {a.repeats} alternating rounds")
    print(f"  all-reduce (after a loss)          median {base * 1000:8.1f} ms")
    for k in a.instances:
        t = statistics.median(times[k])
        print(f"  reduce-scatter, K={k} (S={a.dp // k}) + across  median {t * 1000:8.1f} ms"
              f"  ratio to all-reduce {t / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
