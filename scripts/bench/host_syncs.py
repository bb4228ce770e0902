#!/usr/bin/env python
"""Host syncs per iteration: the training thread's host reads, counted under the emulated NCCL.

    OMP_NUM_THREADS=1 python scripts/bench/host_syncs.py [--iters 4] [--out runs/host_syncs]

Each layout (TP,PP,DP) in (1,1,2), (1,2,2), (2,2,2) trains the tiny GPT failure-free with
RECOVER_EMULATE_NCCL=1 and RECOVER_HOST_READ_SITES set: the logging rank's records carry
`host_syncs` (reads in that iteration) and every rank writes its reads per call site. Printed:
the steady iterations' count on the logging rank, and per call site the reads per iteration,
each marked as the commit's own, Megatron's (grad norm, logged loss), or a host copy (no device
sync on a GPU). A count, not a time: the same run gives the same numbers on any machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests._launch_util import TINY_GPT, launch  # noqa: E402

LAYOUTS = [(1, 1, 2), (1, 2, 2), (2, 2, 2)]
KINDS = {"reduction_tail.py": "commit", "step/commit_vote.py": "commit",
         "global_grad_norm": "Megatron's (grad norm)", "_share_loss_and_times": "Megatron's (loss)",
         "stage.py": "host copy (no device sync on a GPU)"}
START_UP = ("init_parameters_by_name", "_get_param_groups")


def kind_of(site: str) -> str:
    return next((k for key, k in KINDS.items() if key in site), "other")


def measure(out: Path, layout, iters: int) -> tuple[list[int], dict[str, float]]:
    tp, pp, dp = layout
    run_dir = out / "x".join(map(str, layout))
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("*"):
        old.unlink()
    run = launch(tp * pp * dp, [*TINY_GPT, "--train-iters", str(iters),
                                "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp)],
                 run_dir / "metrics.jsonl", launcher_args=[], timeout=300,
                 env={"RECOVER_EMULATE_NCCL": "1",
                      "RECOVER_HOST_READ_SITES": str(run_dir / "sites")})
    if run.returncode != 0:
        raise SystemExit(f"{layout}: exit {run.returncode}\n{run.stderr[-2000:]}")
    counts = [r["host_syncs"] for r in run.records if "host_syncs" in r]
    per_site: dict[str, float] = {}
    for path in sorted(run_dir.glob("sites.*")):  # every rank's; the most reads: the busiest
        sites = json.loads(path.read_text())
        steady = {s: n / iters for s, n in sites.items() if not s.endswith(START_UP)}
        if sum(steady.values()) > sum(per_site.values()):
            per_site = steady
    return counts, per_site


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO / "runs/host_syncs")
    a = p.parse_args()
    for layout in LAYOUTS:
        counts, sites = measure(a.out, layout, a.iters)
        print(f"(TP,PP,DP) = {layout}: host reads per iteration on the logging rank "
              f"{counts[1:]} (the first, {counts[0]}, includes start-up)")
        by_kind: dict[str, float] = {}
        for site, per in sorted(sites.items(), key=lambda kv: -kv[1]):
            by_kind[kind_of(site)] = by_kind.get(kind_of(site), 0.0) + per
            print(f"    {per:5.2f} / iteration  {kind_of(site):38s} {Path(site).name}")
        device = sum(v for k, v in by_kind.items() if not k.startswith("host copy"))
        print(f"    busiest rank: {device:.2f} device syncs per iteration, of them "
              f"{by_kind.get('commit', 0.0):.2f} the commit's own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
