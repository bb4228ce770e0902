"""The CPU context-parallel attention against full causal attention: time and memory per rank
at CP 1 (plain full attention, what a run without CP does), 2 and 4, for each --cp-comm-type
(allgather, p2p, a2a), one attention's forward and backward at a given sequence length.

    OMP_NUM_THREADS=1 python scripts/bench/cp_attention.py --seq 4096 --heads 16 --repeats 5

Each CP size is a gloo job of that many ranks on this machine (one thread each). Per rank: the
median wall time and the median CPU time of the rank's own process (on a machine with fewer cores
than ranks the wall time includes waiting for a core; the CPU time does not), and the growth of
its peak resident memory from before its inputs are made to the end of the first forward and
backward (its queries, keys and values, the gathered ones, activations and gradients). Prints
ratios to CP 1 and writes a plot (--plot).
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.model.context_parallel import context_parallel_attention  # noqa: E402
from megatron.training.model.context_parallel.comm import ring_attention, ulysses_attention  # noqa: E402

KINDS = {"allgather": context_parallel_attention, "p2p": ring_attention, "a2a": ulysses_attention}


def _attention(q, k, v, cp: int, kind: str) -> torch.Tensor:
    if cp == 1:  # no CP: megatron-core's layout through torch's SDPA, as SDPACoreAttention does
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                             is_causal=True)
        return out.permute(2, 0, 1, 3)
    return KINDS[kind](q, k, v, dist.group.WORLD)


def _rank(rank: int, port: int, cp: int, kind: str, shape: tuple[int, int, int, int],
          repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cp)
    seq, batch, heads, dim = shape
    torch.manual_seed(rank)  # values do not matter here; only this rank's chunks are made
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # its inputs count too
    q, k, v = (torch.randn(seq // cp, batch, heads, dim, requires_grad=True) for _ in range(3))
    walls, cpus = [], []
    for _ in range(repeats + 1):  # the first round warms up (and sets the memory peak)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        _attention(q, k, v, cp, kind).sum().backward()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        if len(walls) == 1:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
        q.grad = k.grad = v.grad = None
    results.put((rank, statistics.median(walls[1:]), statistics.median(cpus[1:]), peak / 1024))
    dist.barrier()
    dist.destroy_process_group()


def measure(cp: int, kind: str, shape: tuple[int, int, int, int], repeats: int
            ) -> dict[str, float]:
    """The slowest rank's medians (the one a step waits for) and the largest memory growth."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(port, cp, kind, shape, repeats, results), nprocs=cp,
                       start_method="spawn")
    rows = [results.get() for _ in range(cp)]
    return {"wall": max(r[1] for r in rows), "cpu": max(r[2] for r in rows),
            "mib": max(r[3] for r in rows)}


def plot(table: dict[tuple[str, int], dict[str, float]], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(table, key=lambda row: (row[1], row[0]))
    labels = ["full" if cp == 1 else f"{kind}\nCP {cp}" for kind, cp in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.bar(labels, [table[r]["cpu"] * 1000 for r in rows])
    left.set(ylabel="ms per rank (CPU time)", title="forward + backward")
    right.bar(labels, [table[r]["mib"] for r in rows], color="tab:orange")
    right.set(ylabel="MiB per rank (peak growth)", title="memory")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=sorted(KINDS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    a = p.parse_args(argv)
    if 1 not in a.cp or any(c < 1 or a.seq % (2 * c) for c in a.cp):
        p.error("--cp must include 1, and --seq must be a multiple of 2 x every --cp value")
    if "a2a" in a.kinds and any(a.heads % c for c in a.cp):
        p.error("--kinds a2a splits the heads over CP: --heads must divide by every --cp value")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = (a.seq, a.batch, a.heads, a.head_dim)
    table = {(kind, cp): measure(cp, kind, shape, a.repeats)
             for cp in sorted(a.cp) for kind in (["full"] if cp == 1 else a.kinds)}
    title = (f"causal attention, seq {a.seq}, batch {a.batch}, {a.heads} heads x {a.head_dim}, "
             f"fp32, gloo on CPU, median of {a.repeats}")
    print(title)
    base = table[("full", 1)]
    for (kind, cp), row in table.items():
        print(f"  CP {cp} {kind:9s}: per rank wall {row['wall'] * 1000:9.1f} ms  cpu "
              f"{row['cpu'] * 1000:9.1f} ms  peak +{row['mib']:7.1f} MiB   ratio to CP 1: cpu "
              f"{row['cpu'] / base['cpu']:.2f}  memory {row['mib'] / max(base['mib'], 1e-9):.2f}")
    if a.plot is not None:
        plot(table, title, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
