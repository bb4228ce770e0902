"""What Megatron-FSDP's sharded parameters save and cost, side by side in one run: one shard group
of 4 replicas (`--use-megatron-fsdp`) against the distributed optimizer over the same 4 (weights
whole, main weights and Adam sharded) and plain data parallelism, on a GPT of 8 layers of width
512 (about 25M parameters) in bf16. Printed per layout: rank 0's resident memory after the last
iteration and its peak, the bytes per parameter the start-up line accounts for, and the median
time per iteration (iterations 2 on), each as a ratio to the distributed optimizer's. Runs
alternate (A B C A B C) so that a slow spell of the machine falls on every layout.

glibc raises its mmap threshold each time a large block is freed, after which the blocks the
sharded parameters free and take back every module come from the heap, which keeps the freed
pages: resident memory then grows for a dozen iterations to above the unsharded run's. Every
layout here runs with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB, which keeps large blocks mapped (a
GPU's caching allocator reuses them instead); `--default-malloc` measures without it.

    python scripts/bench/fsdp_memory.py [--default-malloc]    # about 3 minutes on 2 cores
"""
from __future__ import annotations

import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._launch_util import launch  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "250", "--bf16", "--train-iters", "12",
         "--log-interval", "1", "--eval-interval", "1000", "--log-memory-to-tensorboard"]
LAYOUTS = {"distributed optimizer": ["--use-distributed-optimizer"],
           "Megatron-FSDP": ["--use-megatron-fsdp"],
           "plain DP": []}
ROUNDS = 2


COLUMNS = ("RSS after MiB", "peak RSS MiB", "bytes/param said", "ms/iteration")


def measure(flags: list[str], metrics: Path, env: dict) -> tuple[float, ...]:
    """Rank 0's (RSS after the last iteration and peak, in MiB; bytes per parameter said at
    start-up; median ms/iteration)."""
    run = launch(4, [*MODEL, *flags, "--tensorboard-dir", str(metrics.with_suffix(".tb"))],
                 metrics, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    said = re.search(r"= ([\d.]+) bytes per parameter", run.stdout + run.stderr)
    records = [r for r in run.records if "lm_loss" in r]
    memory = records[-1]["memory"]
    return (memory["mem-rss-bytes"] / 2**20, memory["mem-max-rss-bytes"] / 2**20,
            float(said.group(1)) if said else float("nan"),
            statistics.median(r["ms_per_iteration"] for r in records[1:]))


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="fsdp-memory-"))
    env = {} if "--default-malloc" in sys.argv else {"MALLOC_MMAP_THRESHOLD_": "131072"}
    results: dict[str, list[tuple[float, ...]]] = {name: [] for name in LAYOUTS}
    for k in range(ROUNDS):
        for name, flags in LAYOUTS.items():
            results[name].append(measure(flags, out / f"{k}-{name[0]}.jsonl", env))
            print(f"round {k + 1}: {name} done", flush=True)
    base = [statistics.median(v[i] for v in results["distributed optimizer"])
            for i in range(len(COLUMNS))]
    print(f"layout (4 ranks, bf16, {env or 'default malloc'}) | "
          + " | ".join(f"{c} (ratio)" for c in COLUMNS))
    for name, values in results.items():
        cells = []
        for i in range(len(COLUMNS)):
            median = statistics.median(v[i] for v in values)
            cells.append(f"{median:.1f} ({median / base[i]:.2f})")
        print(f"{name} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
