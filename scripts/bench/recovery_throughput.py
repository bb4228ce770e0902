"""Throughput after losing f of D replicas, relative to the ideal (D-f)/D of failure-free, and the
recovery time split into detection / rebuild / recompute (the recovery benchmark).

    OMP_NUM_THREADS=1 python scripts/bench/recovery_throughput.py --dp 2 --fail 1 --repeats 2

Runs the same tiny-GPT job (TP = PP = 1, D replicas) alternately failure-free and with f ranks
SIGKILLed at iteration --fail-at, and compares median ms/iteration of the iterations after the
failure with the failure-free run's. retention = (t_free / t_after) / ((D - f) / D); 1.0 is ideal.
On a machine with fewer cores than ranks, the survivors also get the dead ranks' CPU, which flatters
the number: use --dp <= cores for an honest reading (2 on this machine).

--distributed-optimizer-instances K runs both arms with --use-distributed-optimizer: the recovery's
rebuild then includes re-sharding the optimizer state (the dead replica's slice comes from another
instance); --hidden-size scales the model, and with it the bytes that move.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "4", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--log-interval", "1000", "--eval-interval", "100000", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--recover-balance", "even"]


def run(dp: int, iters: int, faults: list[str], out: Path, extra: list[str]) -> list[dict]:
    args = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(dp),
            "--master-port", "0", "pretrain_gpt_recover.py", *MODEL, *extra,
            "--global-batch-size", str(2 * 4 * dp), "--train-iters", str(iters),
            "--metrics-file", str(out)]
    for f in faults:
        args += ["--inject-fault", f]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="replicas D (one rank each)")
    p.add_argument("--fail", type=int, default=1, help="replicas killed f (< D)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fail-at", type=int, default=8, help="iteration of the kills")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--distributed-optimizer-instances", type=int, default=0, metavar="K",
                   help="0: the plain optimizer; K: --use-distributed-optimizer with K instances")
    a = p.parse_args(argv)
    extra = ["--hidden-size", str(a.hidden_size)]
    if a.distributed_optimizer_instances:
        if a.dp % a.distributed_optimizer_instances:
            p.error("--distributed-optimizer-instances must divide --dp")
        extra += ["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                  str(a.distributed_optimizer_instances)]
    if not 0 < a.fail < a.dp:
        p.error(f"--fail must be between 1 and --dp - 1 = {a.dp - 1}")
    if not 2 <= a.fail_at <= a.iters - 5:
        p.error(f"--fail-at must be between 2 and --iters - 5 = {a.iters - 5}")
    faults = [f"kill:rank={r},iter={a.fail_at},phase=backward" for r in range(a.dp - a.fail, a.dp)]
    free_ms, after_ms, parts, spike = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.repeats):  # interleaved: the machine's load hits both arms alike
            ff = run(a.dp, a.iters, [], Path(tmp) / f"free{k}.jsonl", extra)
            fl = run(a.dp, a.iters, faults, Path(tmp) / f"fail{k}.jsonl", extra)
            free_ms += [r["ms_per_iteration"] for r in ff[a.fail_at + 1:]]
            after_ms += [r["ms_per_iteration"] for r in fl[a.fail_at + 1:]]
            failed = fl[a.fail_at - 1]
            spike.append(failed["ms_per_iteration"] - statistics.median(
                r["ms_per_iteration"] for r in ff[a.fail_at + 1:]))
            parts += [rec["seconds"] for rec in failed["recoveries"]]
            assert all(r["microbatches"] == 4 * a.dp for r in fl), "an iteration lost microbatches"
    t_free, t_after = statistics.median(free_ms), statistics.median(after_ms)
    ideal = (a.dp - a.fail) / a.dp
    retention = (t_free / t_after) / ideal
    print(f"D={a.dp} replicas, f={a.fail} killed at iteration {a.fail_at}, "
          f"{a.repeats} interleaved pairs, M={4 * a.dp} microbatches/iteration, hidden "
          f"{a.hidden_size}, " + (f"distributed optimizer K={a.distributed_optimizer_instances}"
                                  if a.distributed_optimizer_instances else "plain optimizer"))
    print(f"  failure-free   median {t_free:8.1f} ms/iteration")
    print(f"  after failure  median {t_after:8.1f} ms/iteration (same global batch)")
    print(f"  failed iteration: {statistics.median(spike):.0f} ms longer than a failure-free one")
    for name in ("detection", "rebuild", "recompute"):
        vals = [s.get(name, 0.0) * 1000 for s in parts]
        print(f"  recovery {name:9s} median {statistics.median(vals):7.1f} ms  "
              f"(min {min(vals):.1f}, max {max(vals):.1f})")
    print(f"retention after losing {a.fail} of {a.dp}: {retention:.3f} "
          f"(throughput / ((D-f)/D of failure-free); target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
