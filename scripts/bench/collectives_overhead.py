#!/usr/bin/env python
"""Failure-free iteration time of the trainer on layer 1's shim vs. plain gloo groups, as a ratio.

    OMP_NUM_THREADS=1 python scripts/bench/collectives_overhead.py [--rounds 3] [--iters 20]
        [--layouts 1,1,2 1,2,2 2,2,2]

Runs the real trainer (`pretrain_gpt_recover.py` through `python -m recover_patches.launch`) with
the same flags and seed in three arms, interleaved round by round (the arm order rotates each
round, so machine load drifts over all arms alike):
  plain    --no-coordinator: plain torch gloo groups, no coordinator, no commit vote
  shim     coordinator on, --recover off: every group a ResilientProcessGroup (the caller waits
           in the backend; epoch checks), heartbeat and membership threads running; no commit
           vote. shim/plain is layer 1's overhead.
  recover  coordinator on, recovery on: the shim plus layer 2's per-iteration commit (an ack
           over the DP group and an exchange over the replica: `recovery/settle.py`; no store).
           recover/plain is what a user pays for in-job recovery (targets: <= 1.01 at (1,1,2),
           <= 1.02 at (1,2,2) and (2,2,2)).
Each layout (TP,PP,DP) of --layouts runs on TP x PP x DP ranks. The recover arm's records carry the
logging rank's store operations per iteration (`store_ops`, every thread): 0 without a failure.
Per-iteration time is the trainer's own `ms_per_iteration` (metrics file of the logging rank:
the whole transaction -- plan, 1F1B with TP all-reduces and PP p2p, DP reduction, commit, step
with the grad-norm all-reduce -- not start-up, logging or checkpointing). The first `--skip`
iterations of every run are dropped (warm-up). All arms must produce the same losses.

Second part (`--level ops`, also run by default): one process-level loop on 2 ranks holding both a
plain gloo group and a ResilientProcessGroup over the same two ranks, timing blocks of identical
operations alternately on each: all-reduce of 16 KiB (a TP activation of this model) and 1 MiB
(a gradient bucket), and a paired isend/irecv of 16 KiB (pipeline p2p). It prints the shim's
cost per operation, which whole-trainer timings on a loaded 2-core machine cannot resolve.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = {"plain": (["--no-coordinator"], []),
        "shim": ([], ["--recover", "off"]),
        "recover": ([], [])}
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
         "--log-interval", "1000000", "--eval-interval", "1000000", "--eval-iters", "1",
         "--recover-balance", "even"]
BOOTSTRAP_RESAMPLES = 2000
OP_CASES = {"allreduce 16 KiB": 4096, "allreduce 1 MiB": 1 << 18, "p2p pair 16 KiB": 4096}


# --- process-level loop: one rank of a 2-rank job -------------------------------------------
def ops_worker(out: Path, reps: int, block: int) -> None:
    import torch
    import torch.distributed as dist

    from megatron.training.initialize import resilient_group_factory
    from recover_patches.collectives.membership import MembershipClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    membership = MembershipClient.from_env()
    groups = {"plain": dist.new_group([0, 1]),
              "shim": resilient_group_factory(membership, 10.0)("bench.pair", [0, 1])}
    me = dist.get_rank()

    def one_op(case: str, group, x: torch.Tensor, y: torch.Tensor) -> None:
        if case.startswith("p2p"):  # both directions posted before waiting, as StageLink does
            works = [dist.isend(x, group=group, group_dst=1 - me),
                     dist.irecv(y, group=group, group_src=1 - me)]
            for work in works:
                work.wait()
        else:
            dist.all_reduce(x, group=group)

    per_op: dict[str, dict[str, list[float]]] = {c: {"plain": [], "shim": []} for c in OP_CASES}
    for case, floats in OP_CASES.items():
        x, y = torch.zeros(floats), torch.empty(floats)
        for rep in range(reps + 1):  # rep 0 is warm-up; then the arms alternate who goes first
            for arm in (("plain", "shim") if rep % 2 else ("shim", "plain")):
                start = time.perf_counter()
                for _ in range(block):
                    one_op(case, groups[arm], x, y)
                if rep:
                    per_op[case][arm].append((time.perf_counter() - start) / block)
    if me == 0:
        (out / "ops.json").write_text(json.dumps(per_op))
        membership.declare_complete()
    groups["shim"].shutdown()
    membership.close()


def run_ops(args: argparse.Namespace, workdir: Path) -> None:
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "2",
           "--master-port", "0", str(Path(__file__).resolve()), "--ops-worker", str(workdir),
           "--reps", str(args.reps), "--block", str(args.block)]
    code, log = launch(cmd)
    if code != 0 or not (workdir / "ops.json").exists():
        raise SystemExit(f"operation loop failed (exit {code}):\n{log[-3000:]}")
    per_op = json.loads((workdir / "ops.json").read_text())
    print(f"process-level loop: 2 ranks, {args.reps} blocks of {args.block} operations per arm, "
          "alternating")
    print("operation            plain us/op   shim us/op   shim - plain   paired ratio")
    for case, arms in per_op.items():
        plain, shim = statistics.median(arms["plain"]), statistics.median(arms["shim"])
        paired = statistics.median(b / a for a, b in zip(arms["plain"], arms["shim"]))
        print(f"{case:18s} {plain * 1e6:13.0f} {shim * 1e6:12.0f} {(shim - plain) * 1e6:14.0f} "
              f"{paired:14.3f}")


def launch(cmd: list[str], timeout: float = 600) -> tuple[int, str]:
    """Run a launcher command in its own session; SIGKILL that session whatever happens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        log = f"timed out after {timeout} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started for this run only
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, log


# --- whole trainer, three arms ---------------------------------------------------------------


def run_arm(arm: str, layout: tuple[int, int, int], args: argparse.Namespace, workdir: Path,
            round_: int) -> list[dict]:
    launcher_flags, trainer_flags = ARMS[arm]
    tp, pp, dp = layout
    metrics = workdir / f"{arm}.{tp}{pp}{dp}.{round_}.jsonl"
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(tp * pp * dp),
           "--master-port", "0", *launcher_flags, str(REPO / "pretrain_gpt_recover.py"), *MODEL,
           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
           str(pp), "--train-iters", str(args.iters), *trainer_flags,
           "--metrics-file", str(metrics)]
    code, log = launch(cmd)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "lm_loss" in r]
    if code != 0 or len(records) != args.iters:
        raise SystemExit(f"{arm} run {round_} failed (exit {code}):\n{log[-3000:]}")
    return records


def bootstrap_ratio_band(a: list[float], b: list[float], rng: random.Random) -> tuple[float, float]:
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) /
                    statistics.median(rng.choices(b, k=len(b))) for _ in range(BOOTSTRAP_RESAMPLES))
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def trainer_arms(layout: tuple[int, int, int], args: argparse.Namespace, workdir: Path) -> None:
    print(f"whole trainer: (TP, PP, DP) = {layout}, "
          f"tiny GPT (4 layers, hidden 64, seq 64, M = 8); {args.rounds} run(s) per arm x "
          f"{args.iters} iterations, first {args.skip} dropped")
    store_ops: list[int] = []
    commit_share: list[float] = []  # the recover arm's commit phase, as a share of its iteration
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    run_medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    losses: dict[str, list[float]] = {}
    arms = list(ARMS)
    for round_ in range(args.rounds):
        for arm in arms[round_ % len(arms):] + arms[:round_ % len(arms)]:
            records = run_arm(arm, layout, args, workdir, round_)
            store_ops += [r["store_ops"] for r in records[args.skip:] if "store_ops" in r]
            if arm == "recover":
                commit_share += [r["phase_seconds"]["commit"] * 1000 / r["ms_per_iteration"]
                                 for r in records[args.skip:]]
            kept = [r["ms_per_iteration"] for r in records[args.skip:]]
            times[arm] += kept
            run_medians[arm].append(statistics.median(kept))
            losses.setdefault(arm, [r["lm_loss"] for r in records])
            print(f"  round {round_} {arm:8s} median {run_medians[arm][-1]:7.1f} ms/iteration")
    drift = max(abs(a - b) / abs(b) for arm in arms for a, b in zip(losses[arm], losses["plain"]))
    print(f"largest relative loss difference between arms: {drift:.1e} (same seed, same batches)")
    print("arm        median ms    p90 ms    min ms    max ms")
    for arm in arms:
        v = sorted(times[arm])
        print(f"{arm:8s} {statistics.median(v):11.1f} {v[int(0.9 * (len(v) - 1))]:9.1f} "
              f"{v[0]:9.1f} {v[-1]:9.1f}")
    rng = random.Random(0)
    for arm in ("shim", "recover"):
        low, high = bootstrap_ratio_band(times[arm], times["plain"], rng)
        paired = statistics.median(a / b for a, b in zip(run_medians[arm], run_medians["plain"]))
        print(f"ratio {arm}/plain: {statistics.median(times[arm]) / statistics.median(times['plain']):.3f}"
              f"  (ratio of medians; bootstrap 95% band [{low:.3f}, {high:.3f}]; median of "
              f"per-round ratios {paired:.3f}; ratio of minima {min(times[arm]) / min(times['plain']):.3f})")
    if commit_share:  # measured inside each iteration: immune to run-to-run drift of the machine
        print(f"recover arm: the commit (ack + exchange) took a median {statistics.median(commit_share):.2%} "
              f"of the iteration (p90 {sorted(commit_share)[int(0.9 * (len(commit_share) - 1))]:.2%})")
    if store_ops:
        print(f"store operations per iteration by the logging rank: at most {max(store_ops)} "
              f"(median {statistics.median(store_ops):g}) over {len(store_ops)} iterations")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", choices=["both", "trainer", "ops"], default="both")
    p.add_argument("--rounds", type=int, default=3, help="trainer runs per arm (default 3)")
    p.add_argument("--iters", type=int, default=20, help="iterations per run (default 20)")
    p.add_argument("--skip", type=int, default=3, help="warm-up iterations dropped per run (default 3)")
    p.add_argument("--layouts", nargs="+", default=["1,1,2", "1,2,2", "2,2,2"],
                   help="(TP,PP,DP) layouts of the trainer arms (default 1,1,2 1,2,2 2,2,2)")
    p.add_argument("--reps", type=int, default=20, help="op loop: timed blocks per arm (default 20)")
    p.add_argument("--block", type=int, default=50, help="op loop: operations per block (default 50)")
    p.add_argument("--ops-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ops_worker is not None:
        ops_worker(args.ops_worker, args.reps, args.block)
        return 0
    if args.rounds < 1 or args.iters <= args.skip or args.skip < 0:
        p.error("need --rounds >= 1 and 0 <= --skip < --iters (e.g. --iters 20 --skip 3)")
    layouts: list[tuple[int, int, int]] = []
    for text in args.layouts:
        values = [int(v) for v in text.split(",") if v.strip().isdigit()]
        if len(values) != 3 or min(values) < 1:
            p.error("--layouts takes TP,PP,DP triples of positive integers, e.g. 1,1,2 2,2,2")
        layouts.append((values[0], values[1], values[2]))
    if args.reps < 1 or args.block < 1:
        p.error("need --reps >= 1 and --block >= 1 (e.g. --reps 20 --block 50)")
    with tempfile.TemporaryDirectory(prefix="recover_overhead.") as tmp:
        if args.level in ("both", "trainer"):
            for layout in layouts:
                trainer_arms(layout, args, Path(tmp))
        if args.level in ("both", "ops"):
            run_ops(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
