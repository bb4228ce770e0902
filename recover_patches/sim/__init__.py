"""Discrete-event simulator of a large training job under failures, for three strategies:
`recover` (ReCoVer), `drop` (replica dropping) and `checkpoint_restart`. Plain Python + numpy."""

from __future__ import annotations

from recover_patches.sim.checkpoint_restart import simulate_checkpoint_restart
from recover_patches.sim.closed_form import (
    checkpoint_restart_ettr,
    checkpoint_restart_ettr_exponential,
    young_daly_interval,
)
from recover_patches.sim.config import SimConfig, SimConfigError
from recover_patches.sim.elastic import simulate_elastic
from recover_patches.sim.failures import FailureTrace, make_trace
from recover_patches.sim.result import SimResult
from recover_patches.sim.scenarios import SCENARIOS, Scenario

STRATEGIES = ("recover", "drop", "checkpoint_restart")


def simulate(config: SimConfig, strategy: str, seed: int = 0) -> SimResult:
    """Simulate one strategy; the same seed gives every strategy the same failure arrivals."""
    trace = make_trace(config, seed)
    if strategy == "recover":
        return simulate_elastic(config, trace, shrink_batch=False)
    if strategy == "drop":
        return simulate_elastic(config, trace, shrink_batch=True)
    if strategy == "checkpoint_restart":
        return simulate_checkpoint_restart(config, trace)
    raise SimConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def simulate_all(config: SimConfig, seed: int = 0) -> dict[str, SimResult]:
    return {strategy: simulate(config, strategy, seed) for strategy in STRATEGIES}


__all__ = [
    "STRATEGIES", "SCENARIOS", "Scenario", "SimConfig", "SimConfigError", "SimResult", "FailureTrace",
    "make_trace", "simulate", "simulate_all", "checkpoint_restart_ettr", "checkpoint_restart_ettr_exponential",
    "young_daly_interval",
]
