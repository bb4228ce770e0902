"""The chaos soak: `scripts/chaos.py` over many seeds, on gloo and on the emulated NCCL (both of
its modes), until at least --faults-total faults fired; one line per run, the totals, and a plot.

    python scripts/bench/chaos_soak.py [--faults-total 500] [--per-run 25] [--first-seed 100]
                                       [--iters 200] [--out runs/soak]

Every run is the job of tests/test_chaos.py (two launchers of 4 ranks, PP 2, exact reduction,
checkpoints every 10 iterations, T = 3 s) with its own seed; backends cycle gloo, emulated
silent, emulated socket. A run passes when chaos.py exits 0: the job completed, no hang, every
record and the final checkpoint bitwise on the failure-free run. OUT/soak.json keeps every run's
last line; OUT/soak.png shows the faults by kind and the recovery latencies. Exit status 1 if
any run failed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from scripts.chaos.verdict import latencies, percentile, training_records  # noqa: E402
from tests._launch_util import TINY_GPT  # noqa: E402

BACKENDS = (None, "silent", "socket")  # gloo, then the emulated NCCL's two ways to show a loss


def run_once(seed: int, backend: str | None, args: argparse.Namespace) -> dict:
    out = Path(args.out) / f"seed{seed}"
    flags = [*TINY_GPT, "--eval-interval", "20", "--pipeline-model-parallel-size", "2",
             "--recover-exact-reduction", "--recover-timeout", "3", "--train-iters",
             str(args.iters), "--save", str(out / "ckpt"), "--save-interval", "10",
             "--metrics-file", str(out / "metrics.jsonl")]
    cmd = [sys.executable, str(REPO / "scripts/chaos.py"), "--nodes", "2", "--nproc-per-node",
           "4", "--faults", str(args.per_run), "--seed", str(seed), "--out", str(out),
           "--stall-limit", "60", *(["--emulate-nccl", backend] if backend else []), "--", *flags]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() \
        else {"fired": [], "launches": []}
    return {"seed": seed, "backend": backend or "gloo", "status": proc.returncode,
            "seconds": time.monotonic() - started, "fired": [f["name"] for f in summary["fired"]],
            "hangs": sum(launch["hung"] for launch in summary["launches"]),
            "unexpected_ends": sum(launch["status"] not in (None, 0, 3)
                                   for launch in summary["launches"]),
            "line": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:],
            "latencies": latencies(training_records(out / "metrics.jsonl"))}


def plot(runs: list[dict], path: Path) -> None:
    from scripts.plot import pyplot
    plt = pyplot()
    fig, (kinds_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = Counter(name for run in runs for name in run["fired"])
    kinds_ax.bar(list(kinds), list(kinds.values()))
    kinds_ax.set_title(f"{sum(kinds.values())} faults in {len(runs)} runs, by kind")
    kinds_ax.tick_params(axis="x", rotation=45)
    for phase in ("detection", "rebuild", "recompute", "total"):
        values = sorted(v for run in runs for v in run["latencies"][phase])
        if values:
            lat_ax.plot(values, [i / len(values) for i in range(len(values))], label=phase)
    lat_ax.set_xscale("symlog", linthresh=0.01)
    lat_ax.set_xlabel("seconds (in-job recoveries)")
    lat_ax.set_ylabel("fraction of recoveries")
    lat_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults-total", type=int, default=500)
    p.add_argument("--per-run", type=int, default=25)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    seed = args.first_seed
    while sum(len(run["fired"]) for run in runs) < args.faults_total:
        run = run_once(seed, BACKENDS[len(runs) % len(BACKENDS)], args)
        runs.append(run)
        print(f"seed {seed} [{run['backend']}] {'ok' if run['status'] == 0 else 'FAILED'} in "
              f"{run['seconds']:.0f} s: {run['line']}", flush=True)
        (Path(args.out) / "soak.json").write_text(json.dumps(runs, indent=1))
        seed += 1
    plot(runs, Path(args.out) / "soak.png")
    failed = [run["seed"] for run in runs if run["status"] != 0]
    lat = {k: [v for run in runs for v in run["latencies"][k]] for k in runs[0]["latencies"]}
    print(f"soak: {len(runs)} runs, {sum(len(r['fired']) for r in runs)} faults "
          f"({', '.join(f'{k} {n}' for k, n in sorted(Counter(n for r in runs for n in r['fired']).items()))}), "
          f"{sum(r['hangs'] for r in runs)} hangs, "
          f"{sum(r['unexpected_ends'] for r in runs)} unexpected ends, failed runs "
          f"{failed or 'none'}; in-job "
          f"recoveries {len(lat['total'])}, p50/p99 " + ", ".join(
              f"{k} {percentile(v, 0.5):.2f}/{percentile(v, 0.99):.2f} s" for k, v in lat.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
