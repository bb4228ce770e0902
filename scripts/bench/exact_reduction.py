"""What --recover-exact-reduction costs: the same training run with and without it, side by side.

    python scripts/bench/exact_reduction.py --dp 2 --rounds 2 --plot exact_reduction.png

Launches DP gloo ranks of a small GPT (the pretrain script, mock data) --rounds times in each mode,
alternating the modes so the machine's load hits them alike, and prints per mode the median of
each iteration's time and of its execute (forward/backward: the fixed-point accumulation), reduce
and step phases (iterations after the second), the bytes each rank puts on the wire per reduction
(gradients and tail, from the buffers' sizes) and the gradient buffers' bytes per parameter, with
the ratios exact / default. --plot draws the phases per mode.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recover_patches.recovery.fixed_point import SLOTS  # noqa: E402
from recover_patches.recovery.reduction_tail import TailLayout  # noqa: E402
from tests._launch_util import launch  # noqa: E402

PHASES = ("execute", "reduce", "step")


def model_flags(a: argparse.Namespace) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", "4", "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.microbatches), "--lr", "1e-4", "--clip-grad", "1.0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
            "--train-iters", str(a.iters), "--recover-balance", "even"]


def one_run(a: argparse.Namespace, exact: bool, out: Path) -> tuple[dict[str, list[float]], int]:
    """Per-iteration seconds of each phase and of the iteration; the rank's parameter count."""
    flags = model_flags(a) + (["--recover-exact-reduction"] if exact else [])
    run = launch(a.dp, flags, out, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"a {'exact' if exact else 'default'} run failed:\n{run.stderr[-3000:]}")
    records = [r for r in run.records if "lm_loss" in r][2:]  # after warm-up
    times = {p: [r["phase_seconds"][p] for r in records] for p in PHASES}
    times["iteration"] = [r["ms_per_iteration"] / 1000 for r in records]
    params = int(re.search(r"(\d+) parameters on this rank", run.stdout + run.stderr).group(1))
    return times, params


def wire_bytes(params: int, dp: int, exact: bool) -> int:
    """One rank's contribution to the reduction: every gradient and the tail (float32 by default,
    float64 exact, with the fixed-point one-hots; one bucket: no --overlap-grad-reduce)."""
    tail = TailLayout(dp, 0, SLOTS if exact else 0).size
    return (params + tail) * (8 if exact else 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--plot", type=Path, default=None)
    a = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="exact-reduction-"))
    times: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    params = 0
    for k in range(a.rounds):
        for exact in (False, True):
            got, params = one_run(a, exact, out / f"{exact}-{k}.jsonl")
            for phase, values in got.items():
                times[exact].setdefault(phase, []).extend(values)
    median = {e: {ph: statistics.median(v) for ph, v in t.items()} for e, t in times.items()}
    print(f"DP={a.dp} gloo ranks, {params} parameters per rank, {a.microbatches} microbatches, "
          f"{a.rounds} alternating rounds of {a.iters} iterations (the first 2 of each dropped)")
    for phase in ("iteration", *PHASES):
        d, e = median[False][phase], median[True][phase]
        print(f"  {phase:9s} default {d * 1000:8.1f} ms   exact {e * 1000:8.1f} ms   "
              f"ratio {e / d:.2f}")
    d, e = wire_bytes(params, a.dp, False), wire_bytes(params, a.dp, True)
    print(f"  on the wire per rank and reduction: default {d / 2**20:.2f} MiB, exact "
          f"{e / 2**20:.2f} MiB, ratio {e / d:.2f}")
    print("  gradient buffers per parameter: default 8 bytes, exact 20 bytes, ratio 2.50")
    if a.plot is not None:
        plot(median, a.plot)
    return 0


def plot(median: dict[bool, dict[str, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, exact in enumerate((False, True)):
        bottom = 0.0
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange", "tab:green")):
            value = median[exact][phase] * 1000
            ax.bar(i, value, bottom=bottom, color=color, label=phase if i == 0 else None)
            bottom += value
    ax.set_xticks([0, 1], ["default", "--recover-exact-reduction"])
    ax.set_ylabel("ms per iteration (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"  plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
