"""Calibrate the simulator's cost assumptions from costs measured by
`scripts/bench/effective_throughput.py` (its calibration.json).

Two ways to carry a cost measured on a small CPU job over to a large GPU job, both assumptions:
* `per_iteration` (default): each cost keeps its size *in iterations* of the measured job, i.e. it
  is multiplied by (scenario iteration time / measured iteration time). A restart that cost 50
  tiny-GPT iterations costs 50 of the scenario's iterations.
* `absolute`: the measured seconds are used as they are.
Neither is a measurement of a large job: at scale, restart is dominated by scheduling, NCCL
initialisation and reading terabytes of checkpoint, which a CPU loopback job does not exercise.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from scripts.sim.config import SimConfig, SimConfigError

MODES = ("per_iteration", "absolute")


@dataclass(frozen=True)
class MeasuredCosts:
    iteration_seconds: float
    recovery_seconds: float          # in-job recovery (detect + rebuild + recompute)
    checkpoint_save_seconds: float
    restart_seconds: float           # a killed job's relaunch + checkpoint load until it trains again
    join_pause_seconds: float | None = None  # survivors' pause per join (benchmark --replacements)
    OPTIONAL = ("join_pause_seconds",)

    @classmethod
    def from_json(cls, path: Path) -> "MeasuredCosts":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SimConfigError(f"--calibration {path}: cannot read it ({err}); pass the "
                                 "calibration.json written by scripts/bench/effective_throughput.py") from None
        values = {}
        for name in (f.name for f in dataclasses.fields(cls)):
            value = data.get(name)
            if value is None and name in cls.OPTIONAL:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0 or (name == "iteration_seconds" and value == 0):
                raise SimConfigError(f"--calibration {path}: field {name} is missing or not a valid "
                                     f"number of seconds ({value!r}); re-run effective_throughput.py")
            values[name] = float(value)
        return cls(**values)


def calibrate(config: SimConfig, costs: MeasuredCosts, mode: str = "per_iteration") -> SimConfig:
    """The scenario with its recovery, save and restart costs replaced by the measured ones.
    The checkpoint load is part of the measured restart, so the load cost becomes 0."""
    if mode not in MODES:
        raise SimConfigError(f"unknown calibration mode {mode!r}; choose one of {', '.join(MODES)}")
    scale = config.iteration_seconds / costs.iteration_seconds if mode == "per_iteration" else 1.0
    return dataclasses.replace(
        config, recovery_seconds=costs.recovery_seconds * scale,
        checkpoint_save_seconds=costs.checkpoint_save_seconds * scale,
        checkpoint_load_seconds=0.0, restart_seconds=costs.restart_seconds * scale,
        join_pause_seconds=(config.join_pause_seconds if costs.join_pause_seconds is None
                            else costs.join_pause_seconds * scale))
