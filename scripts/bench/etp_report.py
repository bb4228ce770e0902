"""Summaries, the printed table and the plot of the effective-throughput benchmark."""
from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `scripts.*`

from etp_accounting import check_trajectory, committed_curve, committed_records, processed_tokens
from etp_job import ArmRun

FULL_BATCH_ARMS = ("reference", "recover", "checkpoint_restart")  # drop shrinks its batch


@dataclass
class ArmSummary:
    name: str
    launches: int
    failures: int
    processed_tokens: int
    committed_tokens: int
    committed_iterations: int
    tokens_per_second: float
    final_loss: float | None
    recovery_seconds: list[float]   # in-job recoveries (ReCoVer / drop)
    restart_seconds: list[float]    # job stopped by a kill -> first iteration of the relaunch
    unreported_iterations: int      # committed, but the metrics record was lost with the logging rank


def summarize(run: ArmRun, budget: float, microbatches: int) -> ArmSummary:
    committed = check_trajectory(run.attempts, microbatches, run.spec.name in FULL_BATCH_ARMS)
    restarts = []
    for k, attempt in enumerate(run.attempts[1:], start=1):
        killed = [kill.at for kill in run.kills if kill.attempt == k - 1]
        if killed and attempt.first_record_at is not None:
            restarts.append(attempt.first_record_at - killed[-1])
    return ArmSummary(
        name=run.spec.name, launches=len(run.attempts), failures=len(run.kills),
        processed_tokens=processed_tokens(run.attempts),
        committed_tokens=sum(r.tokens for r in committed), committed_iterations=len(committed),
        tokens_per_second=sum(r.tokens for r in committed) / budget,
        final_loss=committed[-1].lm_loss if committed else None,
        recovery_seconds=[s for a in run.attempts for r in a.records for s in r.recovery_seconds],
        restart_seconds=restarts, unreported_iterations=sum(not r.reported for r in committed))


def lost_seconds_per_failure(arm: ArmSummary, reference: ArmSummary | None, budget: float) -> float | None:
    """Budget minus the time the failure-free reference needed for the same committed tokens."""
    if reference is None or arm.failures == 0 or reference.tokens_per_second <= 0:
        return None
    return (budget - arm.committed_tokens / reference.tokens_per_second) / arm.failures


def loss_at_tokens(run: ArmRun, tokens: int) -> float | None:
    """Loss of the committed iteration whose cumulative token count is closest to `tokens`."""
    total, best = 0, None
    for r in committed_records(run.attempts):
        total += r.tokens
        if best is None or abs(total - tokens) < best[0]:
            best = (abs(total - tokens), r.lm_loss)
    return None if best is None else best[1]


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def table(summaries: dict[str, ArmSummary], budget: float) -> str:
    ref = summaries.get("reference")
    cr = summaries.get("checkpoint_restart")
    head = (f"{'arm':<20}{'launches':>9}{'kills':>6}{'processed':>11}{'committed':>11}{'iters':>7}"
            f"{'tok/s':>8}{'vs C/R':>8}{'lost s/fail':>12}{'recov s':>9}{'restart s':>10}{'loss':>8}")
    lines = [head]
    for s in summaries.values():
        ratio = f"{s.tokens_per_second / cr.tokens_per_second:.2f}" if cr and cr.tokens_per_second else "-"
        lost = lost_seconds_per_failure(s, ref, budget)
        lines.append(
            f"{s.name:<20}{s.launches:>9}{s.failures:>6}{s.processed_tokens:>11}{s.committed_tokens:>11}"
            f"{s.committed_iterations:>7}{s.tokens_per_second:>8.1f}{ratio:>8}"
            f"{'-' if lost is None else f'{lost:.1f}':>12}{_median(s.recovery_seconds):>9}"
            f"{_median(s.restart_seconds):>10}{'-' if s.final_loss is None else f'{s.final_loss:.3f}':>8}")
    missing = {s.name: s.unreported_iterations for s in summaries.values() if s.unreported_iterations}
    if missing:
        lines.append(f"iterations committed without a metrics record (logging rank killed between commit "
                     f"and write; counted with the next record's tokens): {missing}")
    return "\n".join(lines)


def plot(runs: dict[str, ArmRun], summaries: dict[str, ArmSummary], out: Path, title: str) -> None:
    from scripts.plot import pyplot
    plt = pyplot()

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        times, tokens = committed_curve(run.attempts)
        line, = axes.step(times, [t / 1000 for t in tokens], where="post", linewidth=1.3,
                          label=f"{name} ({summaries[name].tokens_per_second:.0f} tok/s)",
                          linestyle=":" if name == "reference" else "-")
        for kill in run.kills:
            axes.axvline(kill.at, color=line.get_color(), alpha=0.25, linewidth=0.8)
    axes.set_xlabel("wall-clock seconds (vertical lines: SIGKILL of a rank)")
    axes.set_ylabel("committed tokens (thousands)")
    axes.set_title(title, fontsize=9, wrap=True)  # long run descriptions stay inside the figure
    axes.legend(loc="upper left")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(suffix=".png", dir=out.parent)
    os.close(handle)
    try:
        figure.savefig(temp, dpi=110)
        os.replace(temp, out)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
        plt.close(figure)
