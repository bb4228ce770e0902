"""Kill -> training again at TP x PP x DP, split into detection / rebuild / recompute, with the
groups nobody's failure touched kept (the default) against every group rebuilt.

    OMP_NUM_THREADS=1 python scripts/bench/recovery_breakdown.py [--layout 2,2,2] [--repeats 2]

Runs the same tiny-GPT job (gloo, 8 ranks at 2,2,2) alternately in the two arms, each with one
rank of replica 1 SIGKILLed in its backward pass of iteration --fail-at:
  kept         the default: a group whose members all vouch for its message sequence keeps its
               backend (on rank 0: its TP and PP groups); only the broken ones are rebuilt
  rebuild-all  RECOVER_REGROUP=all: every group is re-created on every survivor (the old way)
Reads rank 0's recovery record from the metrics file: detection (failure seen -> epoch agreed),
rebuild (the regroup, including the rendezvous), recompute (the lost microbatches), and the
failed iteration's extra time over a failure-free one of the same run. On gloo a group costs a
few ms to re-create; NCCL pays 1-10 s per communicator across nodes, which is what keeping saves.
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
sys.path.insert(0, str(REPO))
from scripts.bench.recovery_throughput import MODEL  # noqa: E402  (after the path)
from recover_patches.topology import Topology  # noqa: E402
ARMS = {"kept": {}, "rebuild-all": {"RECOVER_REGROUP": "all"}}


def run(layout: tuple[int, int, int], iters: int, fault: str, out: Path, env: dict) -> list[dict]:
    tp, pp, dp = layout
    args = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node", str(tp * pp * dp),
            "--master-port", "0", "pretrain_gpt_recover.py", *MODEL, "--hidden-size", "128",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--global-batch-size", str(2 * 4 * dp), "--train-iters", str(iters),
            "--recover-timeout", "5", "--metrics-file", str(out), "--inject-fault", fault]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    proc = subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def victim(layout: tuple[int, int, int]) -> int:
    """Replica 1's rank at TP 0 of the last stage."""
    tp, pp, dp = layout
    topo = Topology.from_world(tp * pp * dp, tp, pp, False)
    return topo.pp_ranks(0, 1)[-1]


def measure(layout, iters: int, fail_at: int, repeats: int, progress=print) -> dict[str, dict]:
    fault = f"kill:rank={victim(layout)},iter={fail_at},phase=backward"
    results: dict[str, dict] = {arm: {"seconds": [], "spike": [], "kept": [], "rebuilt": [],
                                      "connect": []}
                                for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(repeats):  # interleaved: the machine's load hits both arms alike
            for arm, env in ARMS.items():
                progress(f"[{k + 1}/{repeats}] {arm} ...")
                recs = [r for r in run(layout, iters, fault, Path(tmp) / f"{arm}{k}.jsonl", env)
                        if "lm_loss" in r]
                failed = recs[fail_at - 1]
                (record,) = failed["recoveries"]
                calm = statistics.median(r["ms_per_iteration"] for r in recs[fail_at:])
                got = results[arm]
                got["seconds"].append(record["seconds"])
                got["spike"].append(failed["ms_per_iteration"] - calm)
                got["kept"].append(record["groups_kept"])
                got["rebuilt"].append(record["groups_rebuilt"])
                got["connect"].append(record["connect_seconds"] * 1000)
    return results


def report(layout, results: dict[str, dict]) -> None:
    print(f"layout (TP,PP,DP) = {layout}, gloo, rank {victim(layout)} (replica 1) killed in "
          f"backward; rank 0's recovery record, median over {len(results['kept']['spike'])} runs")
    med = {}
    for arm, got in results.items():
        parts = {name: statistics.median(s.get(name, 0.0) * 1000 for s in got["seconds"])
                 for name in ("detection", "rebuild", "recompute")}
        med[arm] = parts
        parts["connect"] = statistics.median(got["connect"])
        print(f"  {arm:12s} detection {parts['detection']:7.1f} ms | rebuild "
              f"{parts['rebuild']:7.1f} ms (connecting {parts['connect']:6.1f}) | recompute {parts['recompute']:7.1f} ms | failed "
              f"iteration +{statistics.median(got['spike']):7.1f} ms | groups kept "
              f"{sorted(got['kept'][0])}, rebuilt {len(got['rebuilt'][0])}")
    for part in ("rebuild", "connect"):
        ratio = med["rebuild-all"][part] / max(med["kept"][part], 1e-9)
        print(f"{part} time, rebuild-all / kept: {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="2,2,2", help="TP,PP,DP (DP >= 2)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--fail-at", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    try:
        layout = tuple(int(x) for x in a.layout.split(","))
        assert len(layout) == 3 and min(layout) >= 1 and layout[2] >= 2
    except (ValueError, AssertionError):
        p.error("--layout takes TP,PP,DP with DP >= 2, e.g. 2,2,2")
    if not 2 <= a.fail_at <= a.iters - 2:
        p.error(f"--fail-at must be between 2 and --iters - 2 = {a.iters - 2}")
    report(layout, measure(layout, a.iters, a.fail_at, a.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
