#!/usr/bin/env python
"""Effective throughput under failures: ReCoVer vs drop vs checkpoint-restart, measured here.

    OMP_NUM_THREADS=1 python scripts/bench/effective_throughput.py [--budget 120] [--failure-interval 25]

Runs the same tiny-GPT job (default 4 ranks as (TP,PP,DP) = (1,1,4)) for the same wall-clock
budget per arm, under the same seeded schedule of SIGKILLs of a random live rank:
  reference           no failures, no checkpoints (the failure-free rate; skipped by --no-reference)
  recover             --recover-policy redistribute (ReCoVer)
  drop                --recover-policy drop (replica dropping: the batch shrinks)
  checkpoint_restart  --recover off: a death stops the job (exit 3); relaunched with --load
With --replacements K the launcher of the recover and drop arms starts up to K replacement
processes for killed ranks, which rejoin in the running job (design.md §11): both ReCoVer and
checkpoint-restart (which always relaunches every rank) then get their dead ranks back.
All three failure arms get the same --save/--save-interval, set by Young/Daly
(sqrt(2 * save time * failure interval)) from a short calibration launch, and all three are
relaunched from their latest checkpoint when the whole job stops (ReCoVer and drop only when no
complete replica is left). Committed tokens = tokens of the iterations in the final trajectory.
Writes <out-dir>/results.json, <out-dir>/calibration.json (costs for scripts/sim/run_sim.py
--calibration) and a PNG of committed tokens over time.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from etp_accounting import attempts_to_json  # noqa: E402
from etp_job import ArmRunner, ArmRun, ArmSpec  # noqa: E402
from etp_report import loss_at_tokens, plot, summarize, table  # noqa: E402
from etp_schedule import FailureSchedule  # noqa: E402

STRATEGY_FLAGS = {
    "recover": ["--recover-policy", "redistribute"],
    "drop": ["--recover-policy", "drop"],
    "checkpoint_restart": ["--recover", "off"],
}


def job_args(tp: int, pp: int, train_iters: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(train_iters),
            "--lr", "1e-3", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "250",
            "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "1",
            "--recover-balance", "even", "--async-save"]  # as Megatron's own GPT configs save


MICROBATCHES = 8  # --global-batch-size / --micro-batch-size above


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=120.0, help="wall-clock seconds per arm")
    p.add_argument("--failure-interval", type=float, default=25.0, help="seconds between kills (T)")
    p.add_argument("--max-failures", type=int, default=None, help="cap on kills per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--save-interval", type=int, default=None,
                   help="iterations between checkpoints; default: Young/Daly from a calibration launch")
    p.add_argument("--no-reference", action="store_true", help="skip the failure-free arm")
    p.add_argument("--replacements", type=int, default=0,
                   help="launch --max-replacements for the recover and drop arms: killed ranks "
                        "come back in the running job, as checkpoint-restart's do at a relaunch")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="emulate one device per rank: every rank sleeps this long per microbatch "
                        "forward (--inject-fault slow), so a replica's compute no longer shares the "
                        "machine's cores with the others (0 = off)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/bench/effective_throughput"))
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default <out-dir>/committed_tokens.png)")
    args = p.parse_args(argv)
    for flag, value in (("--budget", args.budget), ("--failure-interval", args.failure_interval)):
        if value <= 0:
            p.error(f"{flag} must be > 0 seconds, got {value}")
    if args.nproc % (args.tp * args.pp) or args.nproc // (args.tp * args.pp) < 2:
        p.error(f"--nproc {args.nproc} must be a multiple of TP*PP={args.tp * args.pp} with at least "
                "2 replicas; pass e.g. --nproc 4 --tp 1 --pp 1")
    if args.device_ms < 0:
        p.error(f"--device-ms must be >= 0, got {args.device_ms}")
    if args.replacements < 0:
        p.error(f"--replacements must be >= 0, got {args.replacements}")
    if args.save_interval is not None and args.save_interval < 1:
        p.error(f"--save-interval must be >= 1, got {args.save_interval}; omit it to use Young/Daly")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        p.error(f"--plot must end in .png, got {args.plot}")
    return args


def calibrate(args, jargs: list[str]) -> dict:
    """One launch saving every iteration: iteration time, save stall (--async-save: the host
    copy and write plan, not the background write), launch-to-training time."""
    spec = ArmSpec("calibration", STRATEGY_FLAGS["recover"], save_interval=1, inject_failures=False,
                   stop_after_records=8)
    runner = ArmRunner(spec, jargs, args.nproc, args.out_dir, FailureSchedule((), ()), budget=600)
    run = runner.execute()
    records = run.attempts[0].records
    if len(records) < 4:
        raise SystemExit(f"calibration launch ran only {len(records)} iterations; see {runner.workdir}")
    saves = []  # the trainer's own measure of how long each save held the loop (async: the copy)
    for _t, line in run.log_lines:
        if "] checkpoint stall: iteration " in line or ": checkpoint stall: iteration " in line:
            it, ms = line.split("checkpoint stall: iteration ", 1)[1].split(" ms")[0].split(", ")
            if int(it) > 1:
                saves.append(float(ms) / 1e3)
    if not saves:
        raise SystemExit(f"calibration saw no timed checkpoint save; see {runner.workdir}")
    return {"iteration_seconds": statistics.median(r.seconds for r in records[1:]),
            "checkpoint_save_seconds": statistics.median(saves),
            "launch_to_first_iteration_seconds": records[0].seen_at}


def young_daly_iterations(save_seconds: float, mtbf_seconds: float, iteration_seconds: float) -> int:
    return max(1, round(math.sqrt(2.0 * save_seconds * mtbf_seconds) / iteration_seconds))


def stop_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through ArmRunner, which kills the running launch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jargs = job_args(args.tp, args.pp, train_iters=1_000_000)
    if args.device_ms:  # why: on 2 shared cores a dead replica frees CPU for the others
        jargs += [a for r in range(args.nproc)
                  for a in ("--inject-fault", f"slow:rank={r},seconds={args.device_ms / 1000:g}")]
    measured = {} if args.save_interval else calibrate(args, jargs)
    save_interval = args.save_interval or young_daly_iterations(
        measured["checkpoint_save_seconds"], args.failure_interval, measured["iteration_seconds"])
    print(f"calibration: {json.dumps(measured)}; save interval {save_interval} iterations"
          + ("" if args.save_interval else " (Young/Daly)"), flush=True)
    schedule = FailureSchedule.seeded(args.seed, args.failure_interval, args.budget, args.max_failures)
    print(f"failure schedule (seed {args.seed}): kills due at "
          + ", ".join(f"{t:.1f}" for t in schedule.times) + " s", flush=True)
    specs = [] if args.no_reference else [ArmSpec("reference", STRATEGY_FLAGS["recover"], None, False)]
    # (one machine plays every node: no limit on one node's failures)
    grow = ["--max-replacements", str(args.replacements), "--failure-window", "0"] \
        if args.replacements else []
    specs += [ArmSpec(name, flags, save_interval,
                      launcher_args=grow if name != "checkpoint_restart" else [])
              for name, flags in STRATEGY_FLAGS.items()]
    runs: dict[str, ArmRun] = {}
    for spec in specs:
        print(f"running {spec.name} for {args.budget:g} s ...", flush=True)
        runs[spec.name] = ArmRunner(spec, jargs, args.nproc, args.out_dir, schedule, args.budget).execute()
    if args.replacements:
        pauses = join_pauses(args.out_dir / "recover")
        print(f"recover: {len(pauses)} join(s), survivors' pause "
              + ", ".join(f"{p * 1000:.0f} ms" for p in pauses), flush=True)
    write_results(args, runs, measured, save_interval, schedule)  # raw data first, whatever follows
    summaries = {name: summarize(run, args.budget, MICROBATCHES) for name, run in runs.items()}
    write_results(args, runs, measured, save_interval, schedule, summaries)
    print(table(summaries, args.budget))
    tokens = min(summaries["drop"].committed_tokens, summaries["recover"].committed_tokens)
    drop_loss, recover_loss = loss_at_tokens(runs["drop"], tokens), loss_at_tokens(runs["recover"], tokens)
    if drop_loss is not None and recover_loss is not None:
        print(f"loss at ~{tokens} committed tokens: drop {drop_loss:.4f}, recover {recover_loss:.4f} "
              "(drop's trajectory differs: its batches shrank)")
    write_outputs(args, runs, summaries, measured, save_interval, schedule)
    return 0


def join_pauses(arm_dir: Path) -> list[float]:
    """The survivors' pause of every join the arm's logging rank recorded (--replacements)."""
    pauses = []
    for path in sorted(arm_dir.glob("metrics.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a killed launch may be cut
            if "join" in record and record["join"]["joined"]:
                pauses.append(record["join"]["seconds"]["pause"])
    return pauses


def write_results(args, runs, measured, save_interval, schedule, summaries=None) -> None:
    results = {"budget": args.budget, "device_ms": args.device_ms, "replacements": args.replacements, "failure_interval": args.failure_interval, "seed": args.seed,
               "nproc": args.nproc, "tp": args.tp, "pp": args.pp, "microbatches": MICROBATCHES,
               "save_interval": save_interval, "schedule": asdict(schedule), "measured": measured,
               "arms": {name: {"summary": asdict(summaries[name]) if summaries else None,
                               "kills": [asdict(k) for k in run.kills],
                               "attempts": attempts_to_json(run.attempts)} for name, run in runs.items()}}
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))


def write_outputs(args, runs, summaries, measured, save_interval, schedule) -> None:
    restarts = summaries["checkpoint_restart"].restart_seconds
    recoveries = summaries["recover"].recovery_seconds
    if measured and restarts and recoveries:
        calibration = {**measured, "recovery_seconds": statistics.median(recoveries),
                       "restart_seconds": statistics.median(restarts),
                       "source": "scripts/bench/effective_throughput.py on this machine"}
        pauses = join_pauses(args.out_dir / "recover")
        if pauses:
            calibration["join_pause_seconds"] = statistics.median(pauses)
        (args.out_dir / "calibration.json").write_text(json.dumps(calibration, indent=1))
        print(f"calibration for the simulator written to {args.out_dir / 'calibration.json'}")
    out = args.plot or args.out_dir / "committed_tokens.png"
    plot(runs, summaries, out, f"tiny GPT, {args.nproc} ranks (TP {args.tp}, PP {args.pp}), "
         f"kill every ~{args.failure_interval:g} s"
         + (f", {args.device_ms:g} ms/microbatch emulated device" if args.device_ms else "")
         + (f", up to {args.replacements} replacements" if args.replacements else ""))
    print(f"plot written to {out}")


if __name__ == "__main__":
    sys.exit(main())
