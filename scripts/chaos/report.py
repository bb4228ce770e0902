"""The end of a chaos run: the verdict, `summary.json`, the plot, and the last line."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from scripts.chaos import verdict
from scripts.chaos.launches import JobHistory
from scripts.chaos.plan import JobShape

RTOL = 1e-5  # without exact reduction: the loss within reduction-order noise


def report(history: JobHistory, shape: JobShape, script: list[str], out: Path,
           ref_metrics: Path, ref_ckpt: Path, ref_wall: float) -> int:
    """Judge, write and print; the exit status: 0 when the job completed without a hang, every
    record matched the failure-free run and (exact reduction) so did the final state."""
    from scripts.chaos.run import flag
    exact = "--recover-exact-reduction" in script
    metrics = Path(str(flag(script, "--metrics-file")))
    reference, records = verdict.training_records(ref_metrics), verdict.training_records(metrics)
    comparison = verdict.compare_records(reference, records, 0.0 if exact else RTOL)
    final = f"iter_{shape.train_iters:07d}"
    state = verdict.compare_states(ref_ckpt / final, Path(str(flag(script, "--save"))) / final) \
        if exact else "not compared (no --recover-exact-reduction)"
    good = verdict.goodput(history, reference, ref_wall, shape.train_iters)
    line = verdict.summary_line(history, records, comparison, state, good)
    (out / "summary.json").write_text(json.dumps({
        "line": line, "fired": [{"fault": f.spec(), "name": f.name, **asdict(i)}
                                for f, i in history.fired],
        "unfired": [f.spec() for f in history.unfired],
        "launches": [{k: v for k, v in asdict(launch).items() if k != "injections"}
                     for launch in history.launches],
        "first_difference": comparison.first_difference}, indent=1))
    resumed = [next(iter(verdict.training_records(metrics, launch.records_from)), {})
               .get("iteration") for launch in history.launches[1:]]
    plot(reference, records, history, [i for i in resumed if i is not None], out / "chaos.png")
    if comparison.first_difference:
        print(f"chaos: first difference: {comparison.first_difference}")
    ok = history.completed and history.hangs == history.unexpected_ends == 0 \
        and comparison.equal == comparison.compared \
        and not comparison.missing and comparison.compared > 0 \
        and (not exact or state is None)
    print(f"chaos: logs, plan and summary in {out}; plot {out / 'chaos.png'}")
    print(line, flush=True)
    return 0 if ok else 1


def plot(reference: list[dict], records: list[dict], history: JobHistory, resumed: list[int],
         path: Path) -> None:
    """The failure-free loss, every record of every launch on it, and where the faults fired
    and the restarts resumed."""
    from scripts.plot import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot([r["iteration"] for r in reference], [r["lm_loss"] for r in reference],
            linewidth=3, alpha=0.4, label="failure-free")
    ax.plot([r["iteration"] for r in records], [r["lm_loss"] for r in records], ".",
            markersize=4, label="chaos: every launch's records")
    colors = plt.get_cmap("tab10")
    names = sorted({fault.name for fault, _ in history.fired})
    for fault, injection in history.fired:
        ax.axvline(injection.iteration, color=colors(names.index(fault.name) % 10), alpha=0.6,
                   linewidth=1, label=fault.name)
    for iteration in resumed:
        ax.axvline(iteration - 0.5, color="black", linestyle="--", linewidth=1, label="restart")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, ncol=2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    restarts = history.restarts
    ax.set_title(f"{len(history.fired)} faults, {restarts} restart{'' if restarts == 1 else 's'}")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
