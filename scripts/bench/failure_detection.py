#!/usr/bin/env python
"""Time from a rank's death to the survivors holding a rebuilt group (layer 1 alone), on loopback.

    OMP_NUM_THREADS=1 python scripts/bench/failure_detection.py [--nproc 6] [--kills 3] [--hangs 1]

Starts N ranks with `python -m recover_patches.launch` (coordinator on, the launcher's default
heartbeat: every 1 s, declared dead after 10 s of silence), every rank holding one
ResilientProcessGroup over all live ranks, made by the trainer's own factory
(`megatron.training.initialize.resilient_group_factory`: operation timeout --recover-timeout,
default 10 s, verdict wait 1 s). The live ranks all-reduce a 1 MiB tensor in a loop. Each round,
the highest live rank writes the time and SIGKILLs itself (`--kills` rounds), then SIGSTOPs itself
(`--hangs` rounds). Every survivor measures, on the shared CLOCK_MONOTONIC:
  failure  fault -> its operation raised PeerFailure
  rebuilt  fault -> it holds the group rebuilt over the survivors (new epoch, fresh gloo backend)
           and one all-reduce over it returned the right sum
This is what layer 2 pays before re-planning; it excludes the store agreement/barrier of a
training job (`recover_patches/recovery/agreement.py`). Target (issue C): rebuilt <= 0.5 s for a
kill. A hang cannot be seen before the heartbeat timeout: its times are printed next to the window
in which the coordinator declares it (silence counts from the last beat, up to one interval early).
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
TARGET_KILL_REBUILT = 0.5
TENSOR_FLOATS = 1 << 18  # 1 MiB of fp32: a small gradient bucket
OPS_BEFORE_FAULT = 20  # every survivor is inside the loop when the victim strikes
GAP = 0.002  # seconds between operations: leave the 2-core machine some air


def launcher_heartbeat_defaults() -> tuple[float, float]:
    """(interval, timeout) as the launcher uses them when not told otherwise."""
    from recover_patches.launch import build_parser
    parser = build_parser()
    return parser.get_default("heartbeat_interval"), parser.get_default("heartbeat_timeout")


HEARTBEAT = launcher_heartbeat_defaults()


# --- one rank ------------------------------------------------------------------------------
def worker(out: Path, kills: int, hangs: int, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from megatron.training.initialize import resilient_group_factory
    from recover_patches.collectives import backends
    from recover_patches.collectives.errors import PeerFailure
    from recover_patches.collectives.membership import MembershipClient

    torch.set_num_threads(1)
    membership = MembershipClient.from_env()
    rank, live = membership.rank, list(range(membership.world_size))
    group = resilient_group_factory(membership, timeout)("bench.all", live)
    records = []
    for round_, kind in enumerate(["kill"] * kills + ["hang"] * hangs):
        victim = live[-1]
        x = torch.ones(TENSOR_FLOATS)
        for done in range(10 ** 9):
            if rank == victim and done == OPS_BEFORE_FAULT:
                (out / f"fault.{round_}").write_text(repr(time.monotonic()))
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
           "--recover-timeout", str(args.recover_timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120 + 30 * args.hangs)
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


def report(results: dict[int, list[dict]]) -> None:
    records = [dict(r, rank=rank) for rank, rs in sorted(results.items()) for r in rs]
    print("round kind victim rank  failure ms  rebuilt ms  op / suspects")
    for r in sorted(records, key=lambda r: (r["round"], r["rank"])):
        print(f"{r['round']:5d} {r['kind']:4s} {r['victim']:6d} {r['rank']:4d} "
              f"{r['failure'] * 1000:11.0f} {r['rebuilt'] * 1000:11.0f}  {r['op']} "
              f"{r['suspects']}{'' if r['confirmed'] else ' (unconfirmed)'}")
    for kind in ("kill", "hang"):
        for key in ("failure", "rebuilt"):
            print(f"{kind} -> {key:8s}: {summarize(records, kind, key)}")
    kills = [r["rebuilt"] for r in records if r["kind"] == "kill"]
    if kills:
        print(f"ratio max(kill -> rebuilt) / target {TARGET_KILL_REBUILT:g} s: "
              f"{max(kills) / TARGET_KILL_REBUILT:.2f}  (median {statistics.median(kills) / TARGET_KILL_REBUILT:.2f})")
    hangs = [r["rebuilt"] for r in records if r["kind"] == "hang"]
    if hangs:  # silence counts from the last heartbeat, up to one interval before the hang
        print(f"hang -> rebuilt: median {statistics.median(hangs):.2f} s, max {max(hangs):.2f} s "
              f"against a declaration window of [{HEARTBEAT[1] - HEARTBEAT[0]:g}, {HEARTBEAT[1]:g}] s "
              f"after the hang (heartbeat timeout {HEARTBEAT[1]:g} s, interval {HEARTBEAT[0]:g} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=6, help="ranks (default 6)")
    p.add_argument("--kills", type=int, default=3, help="SIGKILL rounds (default 3)")
    p.add_argument("--hangs", type=int, default=1, help="SIGSTOP rounds after the kills (default 1)")
    p.add_argument("--recover-timeout", type=float, default=10.0,
                   help="operation timeout of the groups, as the trainer's flag (default 10)")
    p.add_argument("--out", type=Path, default=None, help="directory for per-rank results")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.kills, args.hangs, args.recover_timeout)
        return 0
    if args.kills < 0 or args.hangs < 0 or args.kills + args.hangs < 1:
        p.error("--kills and --hangs must be >= 0, at least one round (e.g. --kills 3)")
    if args.nproc < args.kills + args.hangs + 2:
        p.error(f"--nproc must be >= rounds + 2 so two ranks survive (e.g. --nproc "
                f"{args.kills + args.hangs + 2})")
    out = args.out or Path(f"/tmp/recover_failure_detection.{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.nproc} ranks, {args.kills} kill + {args.hangs} hang round(s), 1 MiB all-reduce "
          f"loop, op timeout {args.recover_timeout:g} s, launcher heartbeat defaults (interval "
          f"{HEARTBEAT[0]:g} s, timeout {HEARTBEAT[1]:g} s)")
    code, log = run_job(args, out)
    results = {int(f.name.split(".")[1]): json.loads(f.read_text()) for f in out.glob("result.*.json")}
    rounds = {r["round"] for rs in results.values() for r in rs}
    if code != 0 or rounds != set(range(args.kills + args.hangs)):
        print(f"job failed (exit {code}, rounds measured {sorted(rounds)}):\n{log[-4000:]}",
              file=sys.stderr)
        return 1
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
