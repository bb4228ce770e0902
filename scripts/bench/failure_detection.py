#!/usr/bin/env python
"""Time from a rank's death to the survivors holding a rebuilt group (layer 1 alone), on loopback.

    OMP_NUM_THREADS=1 python scripts/bench/failure_detection.py [--nproc 7] [--kills 3] [--hangs 1]
        [--stuck 1] [--recover-timeout 10]

Starts N ranks with `python -m recover_patches.launch` (coordinator on; heartbeat interval, stall
timeout and verdict wait derived from --recover-timeout T as the trainer does:
`recover_patches/collectives/timeouts.py`), every rank holding one ResilientProcessGroup over all
live ranks, made by the trainer's own factory (`megatron.training.initialize.
resilient_group_factory`: operation timeout T). The live ranks all-reduce a 1 MiB tensor in a
loop. Each round, the highest live rank writes the time and SIGKILLs itself (`--kills` rounds),
SIGSTOPs itself (`--hangs` rounds: no heartbeat), then sleeps 10 T with its heartbeat thread
beating on (`--stuck` rounds: a live hang, seen only by its progress). Every survivor measures,
on the shared CLOCK_MONOTONIC:
  failure  fault -> its operation raised PeerFailure
  rebuilt  fault -> it holds the group rebuilt over the survivors (new epoch, fresh gloo backend)
           and one all-reduce over it returned the right sum
This is what layer 2 pays before re-planning; it excludes the store agreement/barrier of a
training job (`recover_patches/recovery/agreement.py`). Target: rebuilt <= 0.5 s for a
kill. A hang (stopped or stuck) cannot be seen before its stall timeout T + 0.5 s: its times are
printed next to the window in which the coordinator declares it (silence counts from the last beat,
progress from the last mark seen, each up to one heartbeat interval off). Target: T + <= 1 s.
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
sys.path.insert(0, str(REPO))
from recover_patches.collectives.timeouts import Timeouts  # noqa: E402  (after the path)
TARGET_KILL_REBUILT = 0.5
TENSOR_FLOATS = 1 << 18  # 1 MiB of fp32: a small gradient bucket
OPS_BEFORE_FAULT = 20  # every survivor is inside the loop when the victim strikes
GAP = 0.002  # seconds between operations: leave the 2-core machine some air


# --- one rank ------------------------------------------------------------------------------
def worker(out: Path, kills: int, hangs: int, stuck: int, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from megatron.training.initialize import resilient_group_factory
    from recover_patches.collectives import backends
    from recover_patches.collectives.errors import PeerFailure
    from recover_patches.collectives.membership import MembershipClient

    torch.set_num_threads(1)
    membership = MembershipClient.from_env(timeout=timeout)
    rank, live = membership.rank, list(range(membership.world_size))
    group = resilient_group_factory(membership, timeout)("bench.all", live)
    records = []
    for round_, kind in enumerate(["kill"] * kills + ["hang"] * hangs + ["stuck"] * stuck):
        victim = live[-1]
        x = torch.ones(TENSOR_FLOATS)
        for done in range(10 ** 9):
            if rank == victim and done == OPS_BEFORE_FAULT:
                (out / f"fault.{round_}").write_text(repr(time.monotonic()))
                if kind == "stuck":
                    time.sleep(10 * timeout)  # fenced long before it wakes up
                os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            try:
                dist.all_reduce(x, group=group)
            except PeerFailure as err:
                failed_at, failure = time.monotonic(), err
                break
            time.sleep(GAP)
        epoch = membership.wait_for_epoch_after(failure.epoch, 60)
        live = [r for r in live if r not in membership.dead_ranks()]
        group.rebuild(epoch, live)
        check = torch.tensor([float(rank)])
        dist.all_reduce(check, group=group)
        rebuilt_at = time.monotonic()
        assert check.item() == float(sum(live)), (check.item(), live)
        fault_at = float((out / f"fault.{round_}").read_text())
        records.append({"round": round_, "kind": kind, "victim": victim, "op": failure.op,
                        "suspects": sorted(failure.suspects), "confirmed": failure.confirmed,
                        "failure": failed_at - fault_at, "rebuilt": rebuilt_at - fault_at})
        (out / f"result.{rank}.json").write_text(json.dumps(records))  # a later victim keeps these
    if rank == live[0]:
        membership.declare_complete()
    group.shutdown()
    membership.close()
    backends.join_discards(timeout + 2)


# --- the driver ------------------------------------------------------------------------------
def run_job(args: argparse.Namespace, out: Path) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(args.nproc),
           "--master-port", "0", "--preload", "torch,megatron.core", str(Path(__file__).resolve()),
           "--worker", str(out), "--kills", str(args.kills), "--hangs", str(args.hangs),
           "--stuck", str(args.stuck),
           "--recover-timeout", str(args.recover_timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120 + 3 * args.recover_timeout * (args.hangs + args.stuck))
    except subprocess.TimeoutExpired:
        log = "timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # this job's own session: launcher, coordinator, ranks
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, log


def summarize(records: list[dict], kind: str, key: str) -> str:
    values = sorted(r[key] for r in records if r["kind"] == kind)
    if not values:
        return "-"
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return (f"median {statistics.median(values) * 1000:7.0f} ms  p90 {p90 * 1000:7.0f} ms  "
            f"max {values[-1] * 1000:7.0f} ms  (n={len(values)})")


def report(results: dict[int, list[dict]], timeouts) -> None:
    records = [dict(r, rank=rank) for rank, rs in sorted(results.items()) for r in rs]
    print("round kind victim rank  failure ms  rebuilt ms  op / suspects")
    for r in sorted(records, key=lambda r: (r["round"], r["rank"])):
        print(f"{r['round']:5d} {r['kind']:4s} {r['victim']:6d} {r['rank']:4d} "
              f"{r['failure'] * 1000:11.0f} {r['rebuilt'] * 1000:11.0f}  {r['op']} "
              f"{r['suspects']}{'' if r['confirmed'] else ' (unconfirmed)'}")
    for kind in ("kill", "hang", "stuck"):
        for key in ("failure", "rebuilt"):
            print(f"{kind} -> {key:8s}: {summarize(records, kind, key)}")
    kills = [r["rebuilt"] for r in records if r["kind"] == "kill"]
    if kills:
        print(f"ratio max(kill -> rebuilt) / target {TARGET_KILL_REBUILT:g} s: "
              f"{max(kills) / TARGET_KILL_REBUILT:.2f}  (median {statistics.median(kills) / TARGET_KILL_REBUILT:.2f})")
    stall, interval = timeouts.stall, timeouts.heartbeat_interval
    for kind in ("hang", "stuck"):
        hangs = [r["rebuilt"] for r in records if r["kind"] == kind]
        if hangs:
            print(f"{kind} -> rebuilt: median {statistics.median(hangs):.2f} s, max "
                  f"{max(hangs):.2f} s against a declaration window of [{stall - interval:g}, "
                  f"{stall + interval:g}] s after the fault (stall {stall:g} s, heartbeat "
                  f"{interval:g} s); max - T = {max(hangs) - timeouts.operation:.2f} s (target <= 1)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=7, help="ranks (default 7)")
    p.add_argument("--kills", type=int, default=3, help="SIGKILL rounds (default 3)")
    p.add_argument("--hangs", type=int, default=1, help="SIGSTOP rounds after the kills (default 1)")
    p.add_argument("--stuck", type=int, default=1,
                   help="live-hang rounds (sleep, heartbeat running) after those (default 1)")
    p.add_argument("--recover-timeout", type=float, default=10.0,
                   help="operation timeout of the groups, as the trainer's flag (default 10)")
    p.add_argument("--out", type=Path, default=None, help="directory for per-rank results")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.kills, args.hangs, args.stuck, args.recover_timeout)
        return 0
    rounds = args.kills + args.hangs + args.stuck
    if min(args.kills, args.hangs, args.stuck) < 0 or rounds < 1:
        p.error("--kills, --hangs and --stuck must be >= 0, at least one round (e.g. --kills 3)")
    if args.nproc < rounds + 2:
        p.error(f"--nproc must be >= rounds + 2 so two ranks survive (e.g. --nproc {rounds + 2})")
    if args.recover_timeout < 1:
        p.error("--recover-timeout must be >= 1 (as the trainer's)")
    timeouts = Timeouts(args.recover_timeout)
    out = args.out or Path(f"/tmp/recover_failure_detection.{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.nproc} ranks, {args.kills} kill + {args.hangs} hang + {args.stuck} stuck "
          f"round(s), 1 MiB all-reduce loop, op timeout T = {args.recover_timeout:g} s (heartbeat "
          f"{timeouts.heartbeat_interval:g} s, stall {timeouts.stall:g} s)")
    code, log = run_job(args, out)
    results = {int(f.name.split(".")[1]): json.loads(f.read_text()) for f in out.glob("result.*.json")}
    measured = {r["round"] for rs in results.values() for r in rs}
    if code != 0 or measured != set(range(rounds)):
        print(f"job failed (exit {code}, rounds measured {sorted(measured)}):\n{log[-4000:]}",
              file=sys.stderr)
        return 1
    report(results, timeouts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
