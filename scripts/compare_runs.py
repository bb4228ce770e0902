"""Overlay the loss curves of a failure-free run and a run with failures; mark the failures.

    python scripts/compare_runs.py --reference ref.jsonl --run failed.jsonl --out losses.png

Prints the largest relative loss difference and every recovery, and exits 1 if any iteration did
not commit the reference's microbatches or its loss left the reference by more than --rtol.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `scripts.*`


def read(path: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r for r in records if "lm_loss" in r}


def read_joins(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["join"] for r in records if "join" in r and r["join"]["joined"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--label", default="with failures")
    args = p.parse_args(argv)
    for flag, path in (("--reference", args.reference), ("--run", args.run)):
        if not path.is_file():
            p.error(f"{flag}: {path} does not exist; run the job with --metrics-file {path} first")
    ref, run = read(args.reference), read(args.run)
    common = sorted(set(ref) & set(run))
    worst = max((abs(run[i]["lm_loss"] - ref[i]["lm_loss"]) / abs(ref[i]["lm_loss"]), i)
                for i in common)
    failures = [(i, rec) for i in sorted(run) for rec in run[i].get("recoveries", [])]
    same_batches = all(run[i]["microbatches"] == ref[i]["microbatches"] for i in common)
    print(f"compared {len(common)} iterations: largest relative loss difference {worst[0]:.2e} "
          f"(iteration {worst[1]}); every iteration committed the reference's microbatches: "
          f"{'yes' if same_batches else 'NO'}")
    for i, rec in failures:
        print(f"  iteration {i}: dead ranks {rec['dead']}, lost replicas {rec['lost_replicas']}, "
              f"{len(rec['lost_ids'])} microbatches recomputed by the survivors")
    joins = read_joins(args.run)
    for join in joins:
        print(f"  after iteration {join['iteration']}: replica(s) {join['joined']} re-formed and "
              f"joined (state from replica {join['donor']}, survivors paused "
              f"{join['seconds']['pause'] * 1000:.0f} ms)")

    from scripts.plot import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([i for i in sorted(ref)], [ref[i]["lm_loss"] for i in sorted(ref)],
            label="failure-free", linewidth=3, alpha=0.5)
    ax.plot([i for i in sorted(run)], [run[i]["lm_loss"] for i in sorted(run)],
            label=args.label, linewidth=1.2, linestyle="--")
    for n, (i, rec) in enumerate(failures):
        ax.axvline(i, color="red", alpha=0.6, linewidth=1,
                   label="failure (ranks killed)" if n == 0 else None)
        ax.annotate(f"ranks {rec['dead']} lost", (i, ax.get_ylim()[1]), rotation=90,
                    va="top", ha="right", fontsize=8, color="red")
    for n, join in enumerate(joins):
        ax.axvline(join["iteration"] + 0.5, color="green", alpha=0.6, linewidth=1,
                   label="replica re-formed and joined" if n == 0 else None)
    if all("live_replicas" in r for r in run.values()):
        live = ax.twinx()  # how many replicas did the work: shrinks at a failure, grows at a join
        counts = [len(run[i]["live_replicas"]) for i in sorted(run)]
        live.step(sorted(run), counts, where="post", color="gray", alpha=0.5, linewidth=1)
        live.set_ylabel("live replicas (gray)")
        live.set_ylim(0, max(counts) + 1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"Same trajectory despite failures (max rel. diff {worst[0]:.1e})")
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")
    return 0 if same_batches and worst[0] <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
