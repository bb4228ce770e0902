"""Discrete-event simulator of a large training job under failures, for three strategies:
`recover` (ReCoVer), `drop` (replica dropping) and `checkpoint_restart`. Plain Python + numpy."""

from __future__ import annotations

from scripts.sim.checkpoint_restart import simulate_checkpoint_restart
from scripts.sim.closed_form import (
    checkpoint_restart_ettr,
    checkpoint_restart_ettr_exponential,
    young_daly_interval,
)
from scripts.sim.config import SimConfig, SimConfigError
from scripts.sim.elastic import simulate_elastic
from scripts.sim.failures import FailureTrace, make_trace
from scripts.sim.result import SimResult
from scripts.sim.scenarios import SCENARIOS, Scenario

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
