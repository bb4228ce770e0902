#!/usr/bin/env python
"""The real coordinator under the liveness load of N nodes x 8 ranks: one beat per node (what the
launchers send now, `recover_patches/collectives/node_beats.py`) beside one beat per rank (what
every rank sent before), side by side.

    OMP_NUM_THREADS=1 python scripts/bench/coordinator_load.py [--nodes 1000 4000 12500]
        [--recover-timeout 10] [--warmup 4] [--beaters 2] [--out runs/coordinator_load]

For each N and each arm (`node`, `rank`): the coordinator runs as its own process
(`python -m recover_patches.collectives.coordinator`, the one a job runs); `--beaters` generator
processes write the beats of all N nodes at the heartbeat interval the ranks' --recover-timeout T
gives (node: one line of 8 ranks per node appended to its `hbs/<shard>`; rank: one `hb/<rank>` per rank), each
write its own store request, as a launcher or a rank makes it (a launcher also checks the shard
after each append, for its answer: the generators do so for one node in 8, since waiting for each
answer would need more processes than this machine has cores); the main process registers the
8 N ranks (pipelined handshakes, each saying which node beat carries it). After `--warmup`
seconds of beating: a storm (1 % of the nodes stop at once) and one rank stuck (its beat goes on,
its progress stops; rank 0 reports it waits for it T later, as a timed-out peer would). Printed
per arm: the beat writes/s the generators reached (and the target), the coordinator's CPU (share
of one core over the warm-up), time from each death to the epoch that names it (median, max;
the budget is T + 1 s), time from the storm to the epoch that names all, and the stuck rank's
verdict after its last progress; and, measured apart, the coordinator's own Python work per node
line (`sweep_cost`). The generators run on the same 2 cores as the coordinator: an
arm whose generators fall short of the target rate is marked so and not read as the coordinator's
limit. In the node arm each node's launcher registers too, so the coordinator pushes a new epoch
to the N launchers (which pass it on to their ranks) instead of to the 8 N ranks. Not simulated:
the hop from a rank's file to its launcher (an eighth of an interval), the launchers' relay.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from recover_patches.collectives import protocol as P  # noqa: E402  (after the path)
from recover_patches.collectives.liveness import Liveness  # noqa: E402
from recover_patches.collectives.node_beats import RankAges, format_line, parse_lines  # noqa: E402
from recover_patches.collectives.timeouts import Timeouts  # noqa: E402

RANKS_PER_NODE = 8
CHECK_EVERY = 8  # node arm: a generator checks after one node's append in 8, not after each
TOKEN = "coordinator-load-bench"


def job_store(port: int):
    import torch.distributed as dist
    return dist.PrefixStore(P.job_prefix(TOKEN), P.connect("127.0.0.1", port, 30, "the bench"))


# --- a generator process: the beats of a slice of the nodes ---------------------------------
def beater(port: int, nodes: list[int], arm: str, interval: float, control, done) -> None:
    """Beat `nodes` every `interval` until `control['stop']`; from `control['storm_at']` the
    storm's nodes stay silent, from `control['stuck_at']` the stuck rank's progress is frozen."""
    store = job_store(port)
    storm, stuck = set(control["storm_nodes"]), control["stuck_rank"]
    beats, writes, started = 0, 0, time.monotonic()
    templates = {node: format_line(str(node), {r: RankAges(0.0, 0.0, "e0 it@ forward") for r in
                 range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)}) for node in nodes}
    while not control["stop"]:
        round_start, beats = time.monotonic(), beats + 1
        silent = storm if control["storm_at"] and round_start >= control["storm_at"] else set()
        frozen = control["stuck_at"] and round_start >= control["stuck_at"]
        for node in nodes:
            if node in silent:
                continue
            ranks = range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
            if arm == "node":  # what a launcher appends: ages by its clock (node_beats.py)
                if frozen and stuck in ranks:
                    line = format_line(str(node), {r: RankAges(
                        0.0, round_start - control["stuck_at"], "e0 it1 forward") if r == stuck
                        else RankAges(0.0, 0.0, f"e0 it{beats} forward") for r in ranks})
                else:  # (formatted once per node: the generators' CPU is the bench's limit)
                    line = templates[node].replace("@", str(beats))
                key = P.node_beats_key(str(node))
                store.append(key, line)
                if node % CHECK_EVERY == 0:  # a launcher's check after its append, for one
                    store.check([key])       # node in CHECK_EVERY (see the docstring)
                writes += 1
            else:
                for r in ranks:
                    store.set(P.heartbeat_key(r),
                              f"{beats} e0 it{1 if frozen and r == stuck else beats} forward")
                writes += RANKS_PER_NODE
        time.sleep(max(0.0, interval - (time.monotonic() - round_start)))
    done.put(writes / (time.monotonic() - started))


# --- the main process: the coordinator, registration, faults, verdicts -----------------------
def start_coordinator(world: int, timeout: float, log: Path) -> tuple[subprocess.Popen, int]:
    err = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "recover_patches.collectives.coordinator",
                             "--port", "0", "--world-size", str(world), "--job-token", TOKEN,
                             "--recover-timeout", f"{timeout:g}", "--stay"], cwd=REPO,
                            stderr=err, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if found := re.search(r"serving on port (\d+)", log.read_text()):
            return proc, int(found.group(1))
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the coordinator did not start: {log.read_text()[-500:]}")


def register(port: int, world: int, arm: str, timeout: float, within: float) -> bool:
    """Every rank's handshake, pipelined (a real rank waits for its own reply); False if the
    coordinator did not answer the last one within `within` seconds."""
    raw = P.connect("127.0.0.1", port, within, "the bench")
    digest = P.token_digest(TOKEN)
    last = 0
    for rank in range(world):
        last = raw.add(P.HELLO_COUNT, 1)
        node = str(rank // RANKS_PER_NODE) if arm == "node" else None
        raw.set(P.hello_key(last), json.dumps({
            "digest": digest, "role": "rank", "rank": rank, "incarnation": 0, "standby": None,
            "timeout": timeout, "rejoin": None, "node": node}))
    # node arm: each node's launcher registers too; the coordinator then pushes each epoch to
    # the launchers, which pass it on to their ranks (not simulated: the coordinator's side only)
    for node_rank in range(world // RANKS_PER_NODE if arm == "node" else 0):
        last = raw.add(P.HELLO_COUNT, 1)
        raw.set(P.hello_key(last), json.dumps({
            "digest": digest, "role": "launcher", "rank": node_rank, "node": str(node_rank)}))
    try:
        raw.wait([P.reply_key(last)])
    except RuntimeError:
        return False
    return True


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of the process's main thread (the coordinator's Python loop) and of its other
    threads (the TCPStore server's, serving every beat write and the sweep's reads)."""
    def of(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tasks = Path(f"/proc/{pid}/task")
    main = of(tasks / str(pid) / "stat")
    return main, sum(of(t / "stat") for t in tasks.iterdir() if t.name != str(pid))


class Verdicts:
    """When each rank was first named dead by a published epoch (the store polled every 10 ms)."""

    def __init__(self, store):
        self.store, self.epoch, self.named = store, 0, {}

    def wait_for(self, wanted: set[int], within: float) -> None:
        deadline = time.monotonic() + within
        while wanted - set(self.named) and time.monotonic() < deadline:
            epoch = int(self.store.get(P.EPOCH))
            now = time.monotonic()
            for e in range(self.epoch + 1, epoch + 1):
                for r in json.loads(self.store.get(P.epoch_key(e)))["dead"]:
                    self.named.setdefault(r, now)
            self.epoch = epoch
            time.sleep(0.01)


def faults(port: int, control, timeouts: Timeouts, dead: set[int], stuck_rank: int) -> dict:
    """The storm, then the stuck rank (after the storm's epoch: a waiter's report counts in its
    own epoch); the time each was named dead after its fault."""
    verdicts = Verdicts(job_store(port))
    storm_at = time.monotonic() + 0.05
    control["storm_at"] = storm_at
    verdicts.wait_for(dead, timeouts.stall + 30)
    stuck_at = time.monotonic() + 0.05
    control["stuck_at"] = stuck_at
    time.sleep(0.05 + timeouts.operation)  # the stuck rank's peer times out, and reports it
    P.post_report(verdicts.store, P.Report.make(
        "suspect", rank=0, epoch=verdicts.epoch, suspects=[stuck_rank],
        where="bench: dp.allreduce timed out"))
    verdicts.wait_for({stuck_rank}, timeouts.stall + 30)
    latencies = sorted(verdicts.named[r] - storm_at for r in dead if r in verdicts.named)
    return {"storm_ranks": len(dead), "named": len(latencies),
            "death_to_verdict_median_s": latencies[len(latencies) // 2] if latencies else None,
            "death_to_verdict_max_s": latencies[-1] if len(latencies) == len(dead) else None,
            "stuck_verdict_after_progress_s": verdicts.named[stuck_rank] - stuck_at
            if stuck_rank in verdicts.named else None}


def sweep_cost(nodes: int, rounds: int = 5) -> dict:
    """The coordinator's own Python work per node line, in this process (no store, no other
    load; best of `rounds`): parsing what a sweep takes, recording each node's newest line, and
    the scan for silence (a healthy job: no line parsed further)."""
    live = Liveness(stall=10.5, expiry=21.0)
    for node in range(nodes):
        for r in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE):
            live.watch(r, via=str(node))
    text = "".join(format_line(str(node), {r: RankAges(0.05, 0.2, f"e0 it{node} forward 3")
                                           for r in range(node * RANKS_PER_NODE,
                                                          (node + 1) * RANKS_PER_NODE)})
                   for node in range(nodes))
    best = {"parse": float("inf"), "record": float("inf"), "scan": float("inf")}
    for _ in range(rounds):
        t0 = time.perf_counter()
        lines = parse_lines(text)
        t1 = time.perf_counter()
        for line in lines.values():
            live.observe_node(line)
        t2 = time.perf_counter()
        assert live.silent() == []
        t3 = time.perf_counter()
        for part, seconds in (("parse", t1 - t0), ("record", t2 - t1), ("scan", t3 - t2)):
            best[part] = min(best[part], seconds)
    return {part: seconds / nodes * 1e6 for part, seconds in best.items()}


def run_arm(nodes: int, arm: str, args, out: Path) -> dict:
    timeouts = Timeouts(args.recover_timeout)
    world = nodes * RANKS_PER_NODE
    row = {"nodes": nodes, "arm": arm, "ranks": world, "registered": False,
           "budget_s": timeouts.operation + 1.0}
    if arm == "node":
        row["sweep_us_per_node"] = sweep_cost(nodes)
    proc, port = start_coordinator(world, timeouts.operation, out / f"coordinator-{arm}-{nodes}.log")
    manager = mp.Manager()
    storm_nodes = list(range(1, nodes, 100))[: max(1, nodes // 100)]  # 1 %, never node 0
    stuck_rank = 3  # on node 0, which stays alive
    control = manager.dict(stop=False, storm_at=0.0, stuck_at=0.0, storm_nodes=storm_nodes,
                           stuck_rank=stuck_rank)
    done = manager.Queue()
    slices = [list(range(b, nodes, args.beaters)) for b in range(args.beaters)]
    procs = [mp.get_context("fork").Process(target=beater, daemon=True, args=(
        port, s, arm, timeouts.heartbeat_interval, control, done)) for s in slices]
    try:
        for p in procs:
            p.start()
        t0 = time.monotonic()
        row["registered"] = register(port, world, arm, timeouts.operation, args.register_within)
        row["registered_s"] = time.monotonic() - t0
        if not row["registered"]:
            return row
        cpu0, wall0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(args.warmup)
        cpu1, wall = cpu_seconds(proc.pid), time.monotonic() - wall0
        row["loop_cpu"], row["server_cpu"] = ((b - a) / wall for a, b in zip(cpu0, cpu1))
        row["coordinator_cpu"] = row["loop_cpu"] + row["server_cpu"]
        dead = {n * RANKS_PER_NODE + i for n in storm_nodes for i in range(RANKS_PER_NODE)}
        row.update(faults(port, control, timeouts, dead, stuck_rank))
        control["stop"] = True
        row["writes_per_s"] = sum(done.get(timeout=30) for _ in procs)
    finally:
        control["stop"] = True
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        manager.shutdown()
    row["target_writes_per_s"] = nodes / timeouts.heartbeat_interval * (
        1 if arm == "node" else RANKS_PER_NODE)
    row["generator_short"] = row["writes_per_s"] < 0.9 * row["target_writes_per_s"]
    return row


def fmt(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(rows: list[dict], out: Path, args_budget: float) -> None:
    print(f"{'nodes':>6} {'arm':>4} {'writes/s':>9} {'target':>9} {'loop+server CPU':>15} "
          f"{'death->verdict med/max':>22} {'stuck':>6} {'budget':>6}")
    for r in rows:
        if not r["registered"]:
            print(f"{r['nodes']:>6} {r['arm']:>4} the coordinator did not answer the {r['ranks']} "
                  f"handshakes within {r['registered_s']:.0f} s")
            continue
        short = " (generators short)" if r["generator_short"] else ""
        print(f"{r['nodes']:>6} {r['arm']:>4} {r['writes_per_s']:>9.0f} "
              f"{r['target_writes_per_s']:>9.0f} {r['loop_cpu']:>7.2f}+{r['server_cpu']:<7.2f} "
              f"{fmt(r['death_to_verdict_median_s']):>10} / {fmt(r['death_to_verdict_max_s']):<9} "
              f"{fmt(r['stuck_verdict_after_progress_s']):>6} {r['budget_s']:>6.1f}{short}")
    for r in rows:
        if "sweep_us_per_node" in r:
            cost = r["sweep_us_per_node"]
            print(f"sweep cost at {r['nodes']} nodes, per node line (this process, no load): "
                  f"parse {cost['parse']:.2f} us, record {cost['record']:.2f} us, scan for "
                  f"silence {cost['scan']:.2f} us")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, marker in (("node", "o"), ("rank", "s")):
        mine = [r for r in rows if r["arm"] == arm and r["registered"]]
        xs = [r["nodes"] for r in mine]
        line, = left.plot(xs, [r["writes_per_s"] for r in mine], marker=marker,
                          label=f"{arm} beats (reached)")
        left.plot(xs, [r["target_writes_per_s"] for r in mine], linestyle=":",
                  color=line.get_color(), label=f"{arm} beats (needed)")
        right.plot(xs, [r["death_to_verdict_max_s"] or float("nan") for r in mine],
                   marker=marker, label=f"{arm} beats")
    left.set(xscale="log", yscale="log", xlabel="nodes (x 8 ranks)", ylabel="beat writes / s",
             title="store writes for liveness")
    right.axhline(args_budget, color="grey", linestyle="--", label="T + 1 s")
    right.set(xscale="log", xlabel="nodes (x 8 ranks)", ylabel="s",
              title="storm: death -> verdict (max)")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "coordinator_load.png", dpi=110)
    print(f"wrote {out / 'coordinator_load.json'} and {out / 'coordinator_load.png'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 4000, 12500])
    p.add_argument("--arms", nargs="+", default=["node", "rank"], choices=["node", "rank"])
    p.add_argument("--recover-timeout", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--beaters", type=int, default=2)
    p.add_argument("--register-within", type=float, default=300.0,
                   help="seconds the coordinator may take to answer every handshake")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "coordinator_load")
    args = p.parse_args(argv)
    if min(args.nodes) < 2 or args.beaters < 1 or args.warmup <= 0 or args.recover_timeout < 1:
        print("error: --nodes >= 2 each, --beaters >= 1, --warmup > 0, --recover-timeout >= 1",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nodes in args.nodes:
        for arm in args.arms:
            print(f"[bench] {nodes} nodes, {arm} beats ...", flush=True)
            rows.append(run_arm(nodes, arm, args, args.out))
            (args.out / "coordinator_load.json").write_text(json.dumps(rows, indent=1))
    report(rows, args.out, args.recover_timeout + 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
