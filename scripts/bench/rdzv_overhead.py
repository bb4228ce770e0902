#!/usr/bin/env python
"""Failure-free iteration time with the etcd rendezvous vs node 0's coordinator, as a ratio.

    OMP_NUM_THREADS=1 python scripts/bench/rdzv_overhead.py [--rounds 2] [--iters 30]

The same two-"node" job (two launchers on this host, one rank each, DP 2, tiny GPT) in two arms,
interleaved round by round with the order alternating: `static` (node 0 forks the coordinator,
as before etcd) and `etcd` (`--rdzv-backend etcd` against one local etcd member: every launcher
runs a LeaderAgent that renews or campaigns every lease_ttl / 3 s, the elected launcher forks
the coordinator). A failure-free iteration makes no store operation and no etcd operation in
either arm (etcd is touched by the launchers' agents, off the ranks), so the ratio should be
1 within the machine's noise. Per-iteration time is the trainer's own `ms_per_iteration` (the
metrics file), the first `--skip` iterations dropped; both arms must produce the same losses.
Needs the `etcd` binary (Debian: etcd-server).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests._launch_util import TINY_GPT, base_env  # noqa: E402  (after the path)
from scripts.etcd_members import EtcdMembers  # noqa: E402


def run_job(arm: str, iters: int, work: Path, endpoint: str) -> list[dict]:
    """Both nodes of one job; the metrics records of its logging rank."""
    metrics, token = work / f"{arm}.jsonl", secrets.token_hex(8)
    metrics.unlink(missing_ok=True)
    ports = ["--master-port", "29571", "--coordinator-port", "29572"]
    rdzv = [] if arm == "static" else [
        "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
        "--rdzv-id", f"bench-{token}"]
    procs = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", "1",
                   "--nnodes", "2", "--node-rank", str(node), "--job-token", token, *ports,
                   *rdzv, str(REPO / "pretrain_gpt_recover.py"), *TINY_GPT,
                   "--train-iters", str(iters), "--log-interval", "1000000",
                   # even: the throughput plan follows timing noise, and a moved microbatch
                   # changes the reduction order (losses then differ in the last bits)
                   "--recover-balance", "even",
                   "--metrics-file", str(metrics)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=base_env(), start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{arm}: a launcher exited {proc.returncode}")
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return [json.loads(line) for line in metrics.read_text().splitlines() if "lm_loss" in line]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    members = EtcdMembers(work, 1)
    endpoint = f"127.0.0.1:{members.client_ports[0]}"
    times: dict[str, list[float]] = {"static": [], "etcd": []}
    losses: dict[str, list[float]] = {}
    try:
        for round_ in range(a.rounds):
            for arm in (("static", "etcd") if round_ % 2 == 0 else ("etcd", "static")):
                records = run_job(arm, a.iters, work, endpoint)
                ms = [r["ms_per_iteration"] for r in records[a.skip:]]
                times[arm] += ms
                losses.setdefault(arm, [r["lm_loss"] for r in records])
                print(f"round {round_} {arm:6s} median {statistics.median(ms):7.1f} ms/iteration "
                      f"({len(records)} iterations)", flush=True)
    finally:
        members.stop()
    same = losses["static"] == losses["etcd"]
    ratio = statistics.median(times["etcd"]) / statistics.median(times["static"])
    print(f"etcd / static: {ratio:.3f} (median over {len(times['etcd'])} iterations each); "
          f"losses {'identical' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
