#!/usr/bin/env python
"""What growing back costs: the survivors' pause for one join and the state transfer's bandwidth.

    OMP_NUM_THREADS=1 python scripts/bench/join_cost.py [--model tiny|100m] [--out-dir runs/bench/join]

Runs a (TP, PP, DP) = (1, 1, 2) job, SIGKILLs rank 1 at iteration 2, and lets the launcher start
one replacement (--max-replacements 1) that rejoins as replica 1 with the state of replica 0.
Reads the join record (metrics JSONL, written by the logging rank, which is the donor here) and
prints, side by side with the iteration time of the same run: the survivors' pause (agreement +
group rebuild + transfer + commit vote), the transfer alone, the bytes and MiB/s, and the
in-step recovery that shrank the job when the rank died. Writes <out-dir>/join_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = {
    # the tests' tiny GPT; rank 0 is slowed so the replacement starts before the job ends
    "tiny": ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --vocab-size 250 --global-batch-size 8 --train-iters 14 "
             "--inject-fault slow:rank=0,seconds=0.15,iter=3,phase=forward"),
    # GPT-2-small-like: 12 x 768, 32k vocab: ~110M parameters
    "100m": ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 128 "
             "--max-position-embeddings 128 --vocab-size 32000 --global-batch-size 2 --train-iters 12"),
}
COMMON = ("--micro-batch-size 1 --lr 1e-4 --clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer "
          "--log-interval 1 --eval-interval 1000000 --eval-iters 1 --recover-balance even "
          "--check-weight-hash-across-dp-replicas-interval 1 "
          "--inject-fault kill:rank=1,iter=2,phase=forward")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench/join"))
    opts = p.parse_args()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    metrics = opts.out_dir / f"metrics_{opts.model}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "2",
           "--master-port", "0", "--max-replacements", "1", str(REPO / "pretrain_gpt_recover.py"),
           *MODELS[opts.model].split(), *COMMON.split(), "--metrics-file", str(metrics)]
    print(f"running the {opts.model} job (kill rank 1 at iteration 2, one replacement) ...", flush=True)
    start, log = time.monotonic(), opts.out_dir / f"log_{opts.model}.txt"
    with open(log, "w") as out:  # streamed: a stuck job can be read while it runs
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        try:
            code = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - start
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    joins = [r["join"] for r in records if "join" in r]
    train = [r for r in records if "lm_loss" in r]
    if code != 0 or len(joins) != 1:
        raise SystemExit(f"expected exit 0 and one join, got {code} and {len(joins)} (log: {log})")
    join = joins[0]
    after = [r["ms_per_iteration"] / 1000 for r in train if r["iteration"] > join["iteration"] + 1]
    iteration = statistics.median(after)
    recovery = [sum(rec["seconds"].values()) for r in train for rec in r["recoveries"]]
    pause, transfer = join["seconds"]["pause"], join["seconds"]["transfer"]
    mib = join["bytes_sent"] / 2**20
    result = {"model": opts.model, "state_mib": mib, "pause_s": pause, "transfer_s": transfer,
              "mib_per_s": mib / transfer, "iteration_s": iteration,
              "pause_over_iteration": pause / iteration, "shrink_recovery_s": recovery,
              "joined_after_iteration": join["iteration"], "wall_s": wall,
              "live_replicas": [len(r["live_replicas"]) for r in train]}
    (opts.out_dir / f"join_{opts.model}.json").write_text(json.dumps(result, indent=1))
    print(f"state per rank {mib:.1f} MiB | transfer {transfer * 1000:.0f} ms ({mib / transfer:.0f} MiB/s) "
          f"| survivors' pause {pause * 1000:.0f} ms = {pause / iteration:.2f} x the iteration time "
          f"({iteration * 1000:.0f} ms) | in-step recovery when the rank died: "
          + ", ".join(f"{s * 1000:.0f} ms" for s in recovery)
          + f" | live replicas per iteration {result['live_replicas']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
