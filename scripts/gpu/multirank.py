"""Multi-rank NCCL on one GPU: 4 and 8 ranks share the GPU through
`shared_gpu_rank.py` (own NCCL_HOSTID each, sockets over loopback).

    python3 scripts/gpu/multirank.py [--out runs/gpu/multirank] [--quick] [--survive-minutes 10]

For each layout (TP,PP,DP) in (1,2,2), (2,2,1), (2,1,2), (2,2,2), against one process on the same
GPU with the same global batch:
  free   failure-free: the losses equal one process's (fp32; relative 1e-3 for reduction order)
  kill   a rank of replica 1 SIGKILLed in its backward pass (DP >= 2): survived, same losses
  hang   a rank of replica 1 SIGSTOPped in the DP reduction (DP >= 2): fenced, survived, same
         losses
Counted: synchronizing CUDA calls per iteration (torch.cuda.set_sync_debug_mode, rank 0) and
NCCL communicator inits ("Init COMPLETE" with NCCL_DEBUG=INFO, all ranks) of each run; the
kill run's inits minus the free run's are what its recovery created. --survive-minutes M adds
one kill run at (2,1,2) that trains on for M minutes after the failure: torch's heartbeat
monitor, left on, would end a survivor about 8 minutes after an NCCL error.
Then VP = 2: (1,2,2) free and kill, (1,4,1) free, against one process of the same
8-layer model; and CP = 2: (1,1,2) free and kill.
--quick: only (2,1,2), free and kill; --only NAME...: those runs of the full
plan (a short lease). Results: OUT/summary.json and one line per run on stdout;
exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from recover_patches.topology import Topology  # noqa: E402  (after the path)
from tests._launch_util import TINY_GPT, launch as bounded_launch  # noqa: E402  (kills every rank)

MODEL = [*TINY_GPT, "--recover-balance", "even", "--recover-timeout", "10"]
LAYOUTS = [(1, 2, 2), (2, 2, 1), (2, 1, 2), (2, 2, 2)]
ITERS, FAIL_AT, TOLERANCE = 8, 3, 1e-3


def launch(out: Path, name: str, layout, iters: int, faults: list[str], timeout: float,
           extra: tuple[str, ...] = ()) -> dict:
    tp, pp, dp = layout
    cp = context_parallel(extra)
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("*"):  # a previous harness run's files: metrics are appended to
        old.unlink()
    args = [*MODEL, "--train-iters", str(iters), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), *extra,
            *[a for f in faults for a in ("--inject-fault", f)]]
    start = time.monotonic()
    run = bounded_launch(tp * pp * dp * cp, args, run_dir / "metrics.jsonl", timeout=timeout,
                         env={"NCCL_DEBUG": "INFO", "RECOVER_COUNT_SYNCS": str(run_dir),
                              "RECOVER_STACKS_BEFORE_FENCE": "1"},  # a declared rank's stacks
                         launcher_args=[],  # the coordinator on: in-job recovery
                         script=(str(REPO / "scripts/gpu/shared_gpu_rank.py"),
                                 str(REPO / "pretrain_gpt_recover.py")))
    (run_dir / "stdout.txt").write_text(run.stdout)
    (run_dir / "stderr.txt").write_text(run.stderr)
    syncs = run_dir / "syncs.0.0"
    return {"name": name, "returncode": run.returncode, "seconds": time.monotonic() - start,
            "records": [r for r in run.records if "lm_loss" in r],
            "nccl_inits": len(re.findall(r"Init COMPLETE", run.stdout + run.stderr)),
            "rank0_syncs": int(syncs.read_text()) if syncs.exists() else None}


def context_parallel(flags: tuple[str, ...]) -> int:
    return int(dict(zip(flags[::2], flags[1::2])).get("--context-parallel-size", 1))


def victim(layout, cp: int = 1) -> int:
    """The last rank of replica 1 (with CP, its last CP rank)."""
    tp, pp, dp = layout
    return Topology.from_world(tp * pp * dp * cp, tp, pp, False, cp).pp_ranks(0, 1, cp - 1)[-1]


def check(run: dict, reference: list[float], iters: int) -> list[str]:
    problems = []
    if run["returncode"] != 0:
        problems.append(f"exit status {run['returncode']}")
    losses = [r["lm_loss"] for r in run["records"]]
    if len(losses) != iters:
        problems.append(f"{len(losses)} of {iters} iterations logged")
    drift = max((abs(a - b) / abs(b) for a, b in zip(losses, reference)), default=float("inf"))
    if drift > TOLERANCE:
        problems.append(f"losses drift {drift:.2e} from one process (> {TOLERANCE:g})")
    run["drift"] = drift
    return problems


def summarize(run: dict, problems: list[str]) -> dict:
    records = run.pop("records")
    run["recoveries"] = [r for rec in records for r in rec.get("recoveries", [])]
    run["syncs_per_iteration"] = (run["rank0_syncs"] / len(records)
                                  if run["rank0_syncs"] is not None and records else None)
    run["problems"] = problems
    kept = [len(r["groups_kept"]) for r in run["recoveries"]]
    print(f"{run['name']:18s} {'ok' if not problems else 'FAILED: ' + '; '.join(problems)} | "
          f"{run['seconds']:6.1f} s | drift {run.get('drift', float('nan')):.1e} | NCCL inits "
          f"{run['nccl_inits']} | syncs/iteration (rank 0) {run['syncs_per_iteration']} | "
          f"groups kept by rank 0 {kept}", flush=True)
    return run


VP2 = (("--num-layers", "8"), ("--num-virtual-stages-per-pipeline-rank", "2"))  # model, schedule
CP2 = ((), ("--context-parallel-size", "2"))  # the same model, sequences split in two


def plan(quick: bool) -> list[tuple[str, tuple, list[str], tuple, tuple]]:
    """(name, layout, faults, model flags, schedule flags); runs of one model share a reference."""
    runs = []
    for layout in ([(2, 1, 2)] if quick else LAYOUTS):
        tag = "x".join(map(str, layout))
        runs.append((f"{tag}-free", layout, [], (), ()))
        if layout[2] >= 2:
            runs.append((f"{tag}-kill", layout,
                         [f"kill:rank={victim(layout)},iter={FAIL_AT},phase=backward"], (), ()))
            if not quick:
                runs.append((f"{tag}-hang", layout,
                             [f"hang:rank={victim(layout)},iter={FAIL_AT},phase=dp_reduce"], (), ()))
    if not quick:  # NCCL p2p: the interleaved schedule (VP = 2) over its p2p channels
        runs.append(("1x2x2-vp2-free", (1, 2, 2), [], *VP2))
        runs.append(("1x2x2-vp2-kill", (1, 2, 2),
                     [f"kill:rank={victim((1, 2, 2))},iter={FAIL_AT},phase=backward"], *VP2))
        runs.append(("1x4x1-vp2-free", (1, 4, 1), [], *VP2))
        # CP 2 (the p2p ring over NCCL send/recv), a CP rank killed in its backward
        runs.append(("1x1x2-cp2-free", (1, 1, 2), [], *CP2))
        runs.append(("1x1x2-cp2-kill", (1, 1, 2),
                     [f"kill:rank={victim((1, 1, 2), 2)},iter={FAIL_AT},phase=backward"], *CP2))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs/gpu/multirank")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--survive-minutes", type=float, default=0.0)
    p.add_argument("--run-timeout", type=float, default=420.0,
                   help="seconds a run may take before its ranks are killed (its output is kept)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only these of the full plan (e.g. 2x2x2-kill 1x2x2-vp2-kill)")
    a = p.parse_args(argv)
    references: dict[tuple, list[float]] = {}
    results = []
    runs = [r for r in plan(a.quick) if a.only is None or r[0] in a.only]
    for name, layout, faults, model, schedule in runs:
        if model not in references:  # one process, the same model and global batch
            tag = "".join(f"-{v}" for v in model[1::2])  # "-8": the 8-layer model
            ref = launch(a.out, f"one-process{tag}", (1, 1, 1), ITERS, [], timeout=300,
                         extra=model)
            references[model] = [r["lm_loss"] for r in ref["records"]]
            results.append(summarize(ref, [] if len(references[model]) == ITERS
                                     else ["the one-process reference failed"]))
        run = launch(a.out, name, layout, ITERS, faults, timeout=a.run_timeout,
                     extra=(*model, *schedule))
        results.append(summarize(run, check(run, references[model], ITERS)))
    if a.survive_minutes > 0:
        run = launch(a.out, "2x1x2-survive", (2, 1, 2), 100_000,  # ends by the duration
                     [f"kill:rank={victim((2, 1, 2))},iter={FAIL_AT},phase=backward"],
                     timeout=60 * (a.survive_minutes + 5),
                     extra=("--exit-duration-in-mins", f"{a.survive_minutes + 1:g}"))
        trained, lasted = len(run["records"]), run["seconds"]
        problems = [] if run["returncode"] == 0 and lasted >= 60 * a.survive_minutes else \
            [f"exit status {run['returncode']} after {trained} iterations, {lasted:.0f} s"]
        results.append(summarize(run, problems))
    (a.out / "summary.json").write_text(json.dumps(results, indent=1))
    failed = [r["name"] for r in results if r["problems"]]
    print(f"{len(results) - len(failed)} of {len(results)} runs passed" +
          (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
