"""Draw docs/architecture.png: the packages as layers, and one iteration's data path through the
files that carry it (README, "Architecture"). Usage: python scripts/draw_architecture.py [--out PNG]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `scripts.*`

from scripts.plot import pyplot  # noqa: E402  (after the path)

# (x, y, width, height, title, files) in axes units; y grows upwards
BOXES = {
    "entry": (0.02, 0.81, 0.96, 0.15, "pretrain_gpt_recover.py + megatron/training/",
              "arguments/ (Megatron's flags) -> config/ (RunConfig, frozen, built once) · "
              "training.py (Trainer: loop, records, evaluation)\nstep/ (GPTReplicaStep: "
              "this rank's part of a replica; the schedule, chosen once) · live_job.py "
              "(CheckpointHost, ReplicaState)\ncheckpointing/ (TrainingState) · optimizer/ "
              "(distributed/) · model/ · data/ · step/state_transfer.py"),
    "recovery": (0.02, 0.42, 0.42, 0.30, "layer 2: recover_patches/recovery/",
                 "iteration.py: IterationTransaction\n  (plan, execute, reduce, commit, step,\n"
                 "  recovery rounds) over a ReplicaStep\ngrad_buffer.py: fp32 buckets,\n"
                 "  out-of-place reduction\nreduce.py (Totals) · agreement.py\ngrow.py "
                 "(growing back)"),
    "workload": (0.58, 0.60, 0.40, 0.12, "layer 3: recover_patches/workload/",
                 "policy.py: plan(ids, replicas, timings)\nthroughput.py: MicrobatchTimer"),
    "pipeline": (0.58, 0.42, 0.40, 0.14, "engine: recover_patches/pipeline/",
                 "schedule.py (1F1B, interleaved)\ninterleaved.py (the order) · p2p.py\n"
                 "stage.py · sampler.py · loss.py · rng.py"),
    "collectives": (0.02, 0.17, 0.96, 0.13, "layer 1: recover_patches/collectives/",
                    "group.py: ResilientGroup · process_group.py: ResilientProcessGroup (gloo / "
                    "NCCL inside; PeerFailure) · "
                    "watchdog.py · backends.py\nrendezvous.py (keep, shrink or rebuild a group) · "
                    "membership/ (client) · coordinator.py · nccl_env.py"),
}
COLOURS = {"entry": "#dbe9f6", "recovery": "#fde2c8", "workload": "#e3f1dc",
           "pipeline": "#ece3f4", "collectives": "#f6dada"}
# one iteration's data path: (tail, head, label, label position), box edges in axes units
PATH = [((0.12, 0.81), (0.12, 0.72), "1 the M ids of iteration i", (0.13, 0.765)),
        ((0.44, 0.68), (0.58, 0.66), "2 plan: a\nquota per\nlive replica", (0.45, 0.62)),
        ((0.44, 0.50), (0.58, 0.49), "3 execute\nown ids: grads\ninto the buffer", (0.45, 0.455)),
        ((0.78, 0.42), (0.78, 0.30), "p2p, TP collectives", (0.79, 0.36)),
        ((0.12, 0.42), (0.12, 0.30), "4 reduce grads + counts,\nids, tokens (the commit's)",
         (0.13, 0.36)),
        ((0.36, 0.72), (0.36, 0.81), "5 commit, then step:\noptimizer, LR", (0.37, 0.765))]


def draw(out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(13, 8.5))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    for name, (x, y, w, h, title, files) in BOXES.items():
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=COLOURS[name], edgecolor="#555"))
        ax.text(x + 0.01, y + h - 0.02, title, va="top", fontsize=11, fontweight="bold")
        ax.text(x + 0.01, y + h - 0.055, files, va="top", fontsize=8.5, family="monospace")
    for tail, head, label, (lx, ly) in PATH:
        ax.annotate("", xy=head, xytext=tail,
                    arrowprops={"arrowstyle": "-|>", "color": "#333", "lw": 1.6})
        ax.text(lx, ly, label, fontsize=8.5, va="center")
    ax.text(0.02, 0.04, "Imports point down: megatron/training -> recover_patches -> "
            "megatron.core / torch;\ncollectives <- recovery <- workload, the pipeline engine "
            "beside them (checked by tests/test_layers.py).\nOn a PeerFailure in 2-4 the "
            "transaction agrees on the new epoch, rebuilds only the broken groups,\nre-plans "
            "only the lost ids over the survivors and reduces again.", fontsize=9)
    ax.set_title("ReCoVer: the layers and one iteration's data path", fontsize=13)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "docs" / "architecture.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
