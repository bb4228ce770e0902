#!/usr/bin/env python
"""Pipeline bubble of 1F1B (VP = 1) vs the interleaved schedule (VP = 2), side by side.

    OMP_NUM_THREADS=1 python scripts/bench/interleaved_bubble.py [--device-ms 30] [--repeats 2]

One (TP, PP, DP) = (1, PP, 1) job per arm (default PP 4, 8 layers, 8 microbatches), arms
alternating. Device time is emulated with the `slow` fault on every rank: each microbatch's
forward through a rank's layers sleeps --device-ms and its backward twice that, split evenly over
the rank's model chunks (a chunk holds 1/VP of its layers), so both arms do the same emulated
work and differ only in schedule. Per arm (median over the measured iterations, rank 0):
  execute  seconds in the schedule (forwards, backwards, p2p; `phase_seconds.execute`),
  bubble   1 - emulated busy time (M x 3 x device-ms) / execute,
  model    the bubble ReCoVer's schedule simulation predicts (layer 3's finish-time model).
Prints both arms, the VP2/VP1 ratios of ms per iteration and of execute time, a JSON line, and
writes <out-dir>/interleaved_bubble.png.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from recover_patches.pipeline.interleaved import best_group, makespan  # noqa: E402

LAYERS = 8


def job(pp: int, vp: int, microbatches: int, iters: int, device_ms: float) -> list[str]:
    flags = ["--pipeline-model-parallel-size", str(pp), "--num-layers", str(LAYERS),
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--global-batch-size", str(microbatches), "--train-iters", str(iters),
             "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "250", "--log-interval", "1", "--eval-interval", "1000000",
             "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    if vp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
    per_chunk = device_ms / 1000 / vp
    for rank in range(pp):
        flags += ["--inject-fault", f"slow:rank={rank},seconds={per_chunk:g},phase=forward",
                  "--inject-fault", f"slow:rank={rank},seconds={2 * per_chunk:g},phase=backward"]
    return flags


def run_arm(pp: int, vp: int, a: argparse.Namespace, out: Path) -> list[dict]:
    metrics = out / f"vp{vp}-{len(list(out.glob(f'vp{vp}-*')))}.jsonl"
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(pp),
           "--master-port", "0", "--no-coordinator", str(REPO / "pretrain_gpt_recover.py"),
           *job(pp, vp, a.microbatches, a.warmup + a.iters, a.device_ms),
           "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing it started survives
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0:
        sys.exit(f"the VP={vp} arm failed (exit {proc.returncode}):\n{output[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if "lm_loss" in r][a.warmup:]


def summarize(records: list[dict], pp: int, vp: int, a: argparse.Namespace) -> dict:
    execute = statistics.median(r["phase_seconds"]["execute"] for r in records)
    busy = a.microbatches * 3 * a.device_ms / 1000
    group = best_group(a.microbatches, pp, vp, pp)  # the group size the schedule runs with
    predicted = makespan(a.microbatches, pp, vp, group) / (3 * vp)  # in microbatch times
    return {"vp": vp, "ms_per_iteration": statistics.median(r["ms_per_iteration"] for r in records),
            "execute_ms": 1000 * execute, "bubble": 1 - busy / execute,
            "model_bubble": 1 - a.microbatches / predicted,
            "first_loss": records[0]["lm_loss"]}


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [f"VP = {vp}" for vp in results]
    measured = [100 * r["bubble"] for r in results.values()]
    model = [100 * r["model_bubble"] for r in results.values()]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], model, width=0.4, label="schedule model")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("pipeline bubble (% of schedule time)")
    ax.set_title("1F1B vs interleaved, emulated device time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (ranks); 2 or 4 or 8")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per iteration")
    p.add_argument("--device-ms", type=float, default=30.0,
                   help="emulated forward ms per microbatch per rank (backward: twice)")
    p.add_argument("--iters", type=int, default=4, help="measured iterations per arm")
    p.add_argument("--warmup", type=int, default=2, help="iterations left out per arm")
    p.add_argument("--repeats", type=int, default=1, help="rounds of (VP1, VP2)")
    p.add_argument("--out-dir", type=Path, default=None, help="JSON lines and the plot go here")
    a = p.parse_args(argv)
    if a.pp not in (2, 4, 8):
        p.error("--pp must be 2, 4 or 8 (8 layers split into 2 chunks per rank)")
    for flag, value in (("--microbatches", a.microbatches), ("--iters", a.iters),
                        ("--repeats", a.repeats), ("--device-ms", a.device_ms)):
        if value <= 0:
            p.error(f"{flag} must be > 0")
    out = a.out_dir or Path(tempfile.mkdtemp(prefix="interleaved_bubble-"))
    out.mkdir(parents=True, exist_ok=True)
    records: dict[int, list[dict]] = {1: [], 2: []}
    for round_ in range(a.repeats):
        for vp in (1, 2):
            print(f"round {round_ + 1}/{a.repeats}: VP = {vp} ...", flush=True)
            records[vp] += run_arm(a.pp, vp, a, out)
    results = {vp: summarize(records[vp], a.pp, vp, a) for vp in (1, 2)}
    for r in results.values():
        print(f"VP={r['vp']}: {r['ms_per_iteration']:.0f} ms/iteration, schedule "
              f"{r['execute_ms']:.0f} ms, bubble {100 * r['bubble']:.1f}% (schedule model "
              f"{100 * r['model_bubble']:.1f}%)")
    one, two = results[1], results[2]
    print(f"ratio VP2/VP1: ms per iteration {two['ms_per_iteration'] / one['ms_per_iteration']:.3f}"
          f", schedule time {two['execute_ms'] / one['execute_ms']:.3f}")
    print(f"first measured loss: VP1 {one['first_loss']:.6f} VP2 {two['first_loss']:.6f}")
    print(json.dumps({"pp": a.pp, "microbatches": a.microbatches, "device_ms": a.device_ms,
                      "results": list(results.values())}))
    plot(results, out / "interleaved_bubble.png")
    print(f"plot: {out / 'interleaved_bubble.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
