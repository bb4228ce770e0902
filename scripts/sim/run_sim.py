#!/usr/bin/env python
"""Simulate a large job under failures for recover / drop / checkpoint_restart and plot the timelines.

    python scripts/sim/run_sim.py --scenario paper|llama3|100k|all [--seed N] [--out PNG | --no-plot]
                                  [--calibration calibration.json [--calibration-mode per_iteration|absolute]]

Prints ETTR and tokens per GPU-hour per strategy, with the closed-form C/R ETTR and the Young/Daly
interval to check against; writes a PNG of committed tokens over time (temp file + rename).
--calibration replaces the scenario's assumed recovery/save/restart costs by the ones measured by
scripts/bench/effective_throughput.py (see scripts/sim/calibration.py for how they scale).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `scripts.*`

from scripts.sim import (
    SCENARIOS,
    SimConfigError,
    SimResult,
    checkpoint_restart_ettr,
    checkpoint_restart_ettr_exponential,
    simulate_all,
)
from scripts.sim.calibration import MODES, MeasuredCosts, calibrate
from scripts.sim.recovery_model import models, with_recovery_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True, choices=[*sorted(SCENARIOS), "all"])
    parser.add_argument("--seed", type=int, default=0, help="failure-arrival seed (default 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG path (default runs/sim/<scenario>.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="calibration.json from scripts/bench/effective_throughput.py")
    parser.add_argument("--calibration-mode", choices=MODES, default="per_iteration")
    parser.add_argument("--recovery-model", choices=["assumed", *models()], default="assumed",
                        help="the in-job recovery pause: the scenario's assumption, or verdict + "
                             "group rebuild (scripts/sim/recovery_model.py)")
    return parser.parse_args(argv)


def report(name: str, description: str, results: dict[str, SimResult]) -> str:
    config = next(iter(results.values())).config
    save_hours = config.checkpoint_save_seconds / 3600.0
    costs = (config.interval_hours, save_hours, config.restart_total_hours, config.job_mtbf_hours)
    first_order, exponential = checkpoint_restart_ettr(*costs), checkpoint_restart_ettr_exponential(*costs)
    lines = [f"scenario {name}: {description}",
             f"  {config.gpus} GPUs (TP {config.tp} x PP {config.pp} x DP {config.dp}), "
             f"{config.spare_gpus} spares, {config.run_hours:g} h, job MTBF {config.job_mtbf_hours:.3g} h",
             f"  C/R interval {config.interval_hours * 60:.3g} min; closed-form C/R ETTR: first-order "
             f"{first_order:.3f}, exponential {exponential:.3f}",
             f"  {'strategy':<20}{'ETTR':>8}{'tokens/GPU-h':>15}{'failures':>10}{'replicas':>10}"
             f"{'min batch':>11}"]
    for strategy, result in results.items():
        lines.append(f"  {strategy:<20}{result.ettr:>8.3f}{result.tokens_per_gpu_hour:>15.4g}"
                     f"{result.failures:>10}{result.final_replicas:>10}{result.min_batch_fraction:>11.3f}")
    simulated = results["checkpoint_restart"].ettr
    lines.append(f"  check: simulated C/R ETTR {simulated:.3f} vs closed form {exponential:.3f} "
                 f"(difference {simulated - exponential:+.3f}; one seeded run, the closed form is the mean"
                 f"{'' if config.failure_times_hours is None else ', and assumes Poisson failures, not this trace'})")
    lines.append(f"  costs: recovery {config.recovery_seconds:.3g} s, save {config.checkpoint_save_seconds:.3g} s,"
                 f" restart+load {config.restart_seconds + config.checkpoint_load_seconds:.3g} s,"
                 f" iteration {config.iteration_seconds:.3g} s, replica re-forming {config.rejoin_seconds:.3g} s"
                 f" + a {config.join_pause_seconds:.3g} s pause per join")
    if not results["drop"].trajectory_matches_reference:
        lines.append("  note: drop shrank the global batch, so its training trajectory differs from "
                     "the failure-free reference (recover and checkpoint_restart keep it)")
    return "\n".join(lines)


def plot(results: dict[str, SimResult], title: str, out: Path) -> None:
    from scripts.plot import pyplot
    plt = pyplot()

    styles = {"recover": "-", "drop": "--", "checkpoint_restart": "-"}
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for strategy, result in results.items():
        axes.plot(result.timeline_hours, result.timeline_tokens / 1e9, styles.get(strategy, "-"),
                  label=f"{strategy} (ETTR {result.ettr:.3f})", linewidth=1.2)
    config = next(iter(results.values())).config
    axes.plot([0, config.run_hours], [0, results["recover"].nominal_tokens / 1e9], "k:",
              label="failure-free", linewidth=1)
    axes.set_xlabel("wall-clock hours")
    axes.set_ylabel("committed tokens (billions)")
    axes.set_title(textwrap.fill(title, 90), fontsize=10)  # (a long scenario title wraps)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(suffix=".png", dir=out.parent)
    os.close(handle)
    try:
        figure.savefig(temp, dpi=120)
        os.replace(temp, out)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out is not None and not args.no_plot and args.out.suffix.lower() != ".png":
        print(f"error: --out must end in .png, got {args.out}; pass e.g. --out "
              f"{args.out.with_suffix('.png')}", file=sys.stderr)
        return 2
    if args.scenario == "all" and args.out is not None:
        print("error: --out names one PNG; with --scenario all omit it (plots go to runs/sim/)",
              file=sys.stderr)
        return 2
    try:
        costs = None if args.calibration is None else MeasuredCosts.from_json(args.calibration)
    except SimConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    names = sorted(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        code = run_scenario(name, args, costs)
        if code:
            return code
    return 0


def run_scenario(name: str, args: argparse.Namespace, costs: MeasuredCosts | None) -> int:
    scenario = SCENARIOS[name]()
    config, suffix = scenario.config, ""
    if costs is not None:
        config, suffix = calibrate(config, costs, args.calibration_mode), "_calibrated"
    if args.recovery_model != "assumed":  # after calibrating: the model replaces the pause
        config = with_recovery_model(config, args.recovery_model)
        suffix += f"_{args.recovery_model}"
    out = args.out or Path("runs") / "sim" / f"{scenario.name}{suffix}.png"
    results = simulate_all(config, seed=args.seed)
    label = scenario.description + ("" if costs is None else f" [costs measured, {args.calibration_mode}]") \
        + ("" if args.recovery_model == "assumed" else f" [recovery: {args.recovery_model} groups]")
    print(report(scenario.name, label, results))
    if not args.no_plot:
        try:
            plot(results, f"{scenario.name}: {label}", out)
        except OSError as error:
            print(f"error: cannot write --out {out}: {error.strerror}; choose a writable path",
                  file=sys.stderr)
            return 2
        print(f"plot written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
