"""The fault matrix on the emulated NCCL (RECOVER_EMULATE_NCCL=1): NCCL's blocking rules on CPU.

    python scripts/emulated_nccl_matrix.py [--out runs/emulated] [--quick | --wide] [--gloo]
                                           [--only NAME...]

Kill and hang in every phase the fault injector reaches in a plain training run, at (2,1,2),
(1,2,2) and (2,2,2); then VP 2, CP 2, EP 2, the distributed optimizer with K = 2 instances
(killed in its weight gather, killed and hung in every phase), a replacement joining
(--max-replacements 1) and a kill during an async torch_dist save. --wide adds EP 2, CP 2,
Megatron-FSDP, exact reduction and VP 2 in every phase, a kill during a recovery and one in an
evaluation; --gloo runs the plan on plain gloo instead. Each run must finish every iteration
with the failure-free losses (relative 1e-5) within its bound, and is printed as one line; exit
status 1 if any failed. The plain model's reference is one process; VP's and EP's, which one
process cannot run, the failure-free run of their layout. --quick: the cases
tests/test_emulated_nccl_faults.py leaves out but CI can afford. A tqdm bar shows progress;
OUT/summary.json keeps every run's outcome.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from recover_patches.topology import Topology  # noqa: E402  (after the path)
from tests._launch_util import TINY_GPT, launch  # noqa: E402

ITERS, FAIL_AT, TOLERANCE, T = 5, 3, 1e-5, 3.0
# the phases a plain run passes through (p2p with PP, tp_allreduce with TP, param_gather with
# the distributed optimizer, the rest always); checkpoint, join, eval, cp/ep: their own cases
PHASES = ("forward", "backward", "p2p", "tp_allreduce", "dp_reduce", "reduced", "ack",
          "exchange", "confirmed", "optimizer")
VP2 = ("--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2")
EP2 = ("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall")
# the distributed optimizer's victim is in instance 0, whose lowest rank is a reshard's source;
# --quick: only the phases after the vote, whose collectives span the instance's replicas
AFTER_COMMIT = ("confirmed", "optimizer")
DISTOPT = ("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")


def victim(layout, cp: int = 1) -> int:
    """The last rank of replica 1."""
    tp, pp, dp = layout
    return Topology.from_world(tp * pp * dp * cp, tp, pp, False, cp).pp_ranks(0, 1, cp - 1)[-1]


def applies(phase: str, layout) -> bool:
    tp, pp, _ = layout
    return not (phase == "p2p" and pp == 1 or phase == "tp_allreduce" and tp == 1)


FSDP = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--num-distributed-optimizer-instances", "2")
EXACT = ("--recover-exact-reduction", *DISTOPT)
# --wide: the single-phase layouts above in every phase, kill and hang (name, layout, model
# flags, extra flags, victim); the victim is in the first unit or instance
WIDE = (("1x1x4-ep2", (1, 1, 4), EP2, (), 1),
        ("1x1x2-cp2", (1, 1, 2), (), ("--context-parallel-size", "2"), 1),
        ("1x1x4-fsdp-k2", (1, 1, 4), (), FSDP, 1),
        ("1x1x4-exact-distopt-k2", (1, 1, 4), (), EXACT, 1),
        ("1x2x2-vp2", (1, 2, 2), VP2, (), victim((1, 2, 2))))


def wide_plan() -> list[tuple[str, tuple, tuple[str, ...], list[str], tuple, tuple]]:
    runs = [(f"{tag}-{kind}-{phase}", layout, model,
             [f"{kind}:rank={rank},iter={FAIL_AT},phase={phase}"], extra, ())
            for tag, layout, model, extra, rank in WIDE for kind in ("kill", "hang")
            for phase in PHASES if applies(phase, layout)]
    return runs + [  # a second failure while the survivors recover; a kill in an evaluation
        ("1x1x4-kill-during-recovery", (1, 1, 4), (), [
            f"kill:rank=1,iter={FAIL_AT},phase=forward",
            f"kill:rank=3,iter={FAIL_AT},phase=recovery"], (), ()),
        ("1x1x4-kill-in-eval", (1, 1, 4), (), [f"kill:rank=2,iter={FAIL_AT - 1},phase=eval"],
         ("--eval-interval", "2", "--eval-iters", "1"), ())]


def plan(quick: bool, wide: bool = False
         ) -> list[tuple[str, tuple, tuple[str, ...], list[str], tuple, tuple]]:
    """(name, layout, model flags, faults, extra flags, launcher flags)."""
    runs = wide_plan() if wide else []
    layouts = [(2, 2, 2)] if quick else [(2, 1, 2), (1, 2, 2), (2, 2, 2)]
    phases = ("p2p", "exchange", "optimizer") if quick else PHASES
    for layout in layouts:
        tag = "x".join(map(str, layout))
        for kind in ("kill", "hang"):
            for phase in phases:
                if applies(phase, layout):
                    runs.append((f"{tag}-{kind}-{phase}", layout, (), [
                        f"{kind}:rank={victim(layout)},iter={FAIL_AT},phase={phase}"], (), ()))
    v = victim((1, 2, 2))
    runs += [
        ("1x2x2-vp2-kill-p2p", (1, 2, 2), VP2, [f"kill:rank={v},iter={FAIL_AT},phase=p2p"], (), ()),
        ("1x1x2-cp2-kill-cp", (1, 1, 2), (), [
            f"kill:rank={victim((1, 1, 2), 2)},iter={FAIL_AT},phase=cp_exchange"],
         ("--context-parallel-size", "2"), ()),
        ("1x1x4-ep2-kill-alltoall", (1, 1, 4), EP2, [
            f"kill:rank=3,iter={FAIL_AT},phase=ep_alltoall"], (), ()),
        ("1x1x4-distopt-k2-kill-gather", (1, 1, 4), (), [
            f"kill:rank=3,iter={FAIL_AT},phase=param_gather"], DISTOPT, ()),
        *[(f"1x1x4-distopt-k2-{kind}-{phase}", (1, 1, 4), (), [
            f"{kind}:rank=1,iter={FAIL_AT},phase={phase}"], DISTOPT, ())
          for kind in ("kill", "hang") for phase in (AFTER_COMMIT if quick else PHASES)
          if applies(phase, (1, 1, 4))],
        ("1x1x2-replacement-joins", (1, 1, 2), (), [f"kill:rank=1,iter={FAIL_AT},phase=backward"],
         (), ("--max-replacements", "1")),
        ("1x1x2-kill-in-async-save", (1, 1, 2), (), ["kill:rank=1,iter=2,phase=checkpoint"],
         ("--save-interval", "2", "--async-save", "--ckpt-format", "torch_dist"), ()),
    ]
    return list({run[0]: run for run in runs}.values())  # (--wide repeats VP 2's p2p kill)


def run_one(out: Path, name: str, layout, model, faults, extra, launcher, timeout: float,
            emulated: bool = True):
    tp, pp, dp = layout
    cp = int(dict(zip(extra[::2], extra[1::2])).get("--context-parallel-size", 1))
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    save = ["--save", tempfile.mkdtemp(prefix="recover-matrix-")] if "--save-interval" in extra \
        else []
    args = [*TINY_GPT, *model, "--train-iters", str(ITERS), "--recover-timeout", f"{T:g}",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--recover-balance", "even", *extra, *save,
            *[a for f in faults for a in ("--inject-fault", f)]]
    start = time.monotonic()
    run = launch(tp * pp * dp * cp, args, metrics, timeout=timeout,
                 env={"RECOVER_EMULATE_NCCL": "1" if emulated else "0"},
                 launcher_args=list(launcher))
    (run_dir / "stdout.txt").write_text(run.stdout)
    (run_dir / "stderr.txt").write_text(run.stderr)
    return run, time.monotonic() - start


def problems_of(run, reference: list[float]) -> list[str]:
    found = [] if run.returncode == 0 else [f"exit status {run.returncode}"]
    losses = run.losses()
    if len(losses) != ITERS:
        found.append(f"{len(losses)} of {ITERS} iterations")
    drift = max((abs(a - b) / abs(b) for a, b in zip(losses, reference)), default=float("inf"))
    if drift > TOLERANCE:
        found.append(f"losses drift {drift:.1e}")
    if re.search(r"^timed out after [\d.]+s$", run.stderr, re.M):  # the bound's line, not
        found.append("hung")  # torch's socket warnings ("timed out after 1000ms")
    return found


def reference_key(layout, model) -> tuple:
    """The plain model's losses are one process's; a model one process cannot run (VP, EP) is
    held to the failure-free run of its own layout."""
    return (model, layout) if model else ()


def reference_losses(out: Path, layout, model) -> list[float]:
    ref, _ = run_one(out, "failure-free" + "-".join(model[1::2]), layout if model else (1, 1, 1),
                     model, [], (), (), 300)
    return ref.losses()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs/emulated")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--wide", action="store_true", help="also EP 2, CP 2, Megatron-FSDP, exact "
                   "reduction with the distributed optimizer and VP 2 in every phase; a kill "
                   "during a recovery, and in an evaluation")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME")
    p.add_argument("--run-timeout", type=float, default=150.0)
    p.add_argument("--gloo", action="store_true", help="the same plan on plain gloo, whose "
                   "failures are raised at once (the CPU suite's backend)")
    a = p.parse_args(argv)
    runs = [r for r in plan(a.quick, a.wide) if a.only is None or r[0] in a.only]
    references: dict[tuple, list[float]] = {}
    results = []
    for name, layout, model, faults, extra, launcher in tqdm(runs, unit="run", file=sys.stderr):
        key = reference_key(layout, model)
        if key not in references:
            references[key] = reference_losses(a.out, layout, model)
        run, seconds = run_one(a.out, name, layout, model, faults, extra, launcher,
                               a.run_timeout, emulated=not a.gloo)
        found = problems_of(run, references[key])
        results.append({"name": name, "seconds": round(seconds, 1), "problems": found})
        tqdm.write(f"{name:32s} {'ok' if not found else 'FAILED: ' + '; '.join(found)} | "
                   f"{seconds:5.1f} s")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(results, indent=1))
    failed = [r["name"] for r in results if r["problems"]]
    print(f"{len(results) - len(failed)} of {len(results)} "
          f"{'gloo' if a.gloo else 'emulated-NCCL'} fault runs survived "
          "with the failure-free losses" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
