"""Inputs of the failure simulator: job shape, failure model, costs. Times in the unit of each name."""

from __future__ import annotations

import math
from dataclasses import dataclass


class SimConfigError(ValueError):
    """A simulator input is out of range; the message names the field and the fix."""


@dataclass(frozen=True)
class SimConfig:
    """One large training job and its failure environment.

    Defaults marked (assumption) are placeholders, not measurements; a later step calibrates them.
    """

    tp: int
    pp: int
    dp: int
    iteration_seconds: float            # one iteration of the full global batch on all dp replicas
    tokens_per_iteration: float         # global batch in tokens
    run_hours: float                    # wall-clock horizon of the simulated run
    gpu_mtbf_hours: float | None = None               # per-GPU mean time between failures
    failure_times_hours: tuple[float, ...] | None = None  # explicit trace; overrides gpu_mtbf_hours
    spare_gpus: int = 0                 # idle healthy GPUs allocated next to the job
    repair_hours: float | None = None   # a failed GPU returns healthy after this; None = never
    recovery_seconds: float = 30.0      # (assumption) ReCoVer/drop: detect + rebuild DP groups + re-plan
    rejoin_seconds: float = 120.0       # (assumption) a re-formed replica gets state from a peer
    join_pause_seconds: float = 0.0     # survivors' pause when a replica joins (measured: the
    #                                     trainer's join meets at an iteration boundary)
    checkpoint_save_seconds: float = 60.0    # (assumption) job paused while a checkpoint is written
    checkpoint_load_seconds: float = 120.0   # (assumption) reading the checkpoint back after a restart
    restart_seconds: float = 300.0           # (assumption) reschedule, relaunch, initialise
    checkpoint_interval_hours: float | None = None  # compute time between checkpoints; None = Young/Daly

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.spare_gpus, bool) or not isinstance(self.spare_gpus, int) or self.spare_gpus < 0:
            raise SimConfigError(f"spare_gpus must be an integer >= 0, got {self.spare_gpus!r}")
        for name in ("iteration_seconds", "tokens_per_iteration", "run_hours"):
            _require(name, getattr(self, name), positive=True)
        for name in ("recovery_seconds", "rejoin_seconds", "join_pause_seconds", "checkpoint_save_seconds",
                     "checkpoint_load_seconds", "restart_seconds"):
            _require(name, getattr(self, name), positive=False)
        for name in ("gpu_mtbf_hours", "checkpoint_interval_hours"):
            if getattr(self, name) is not None:
                _require(name, getattr(self, name), positive=True, allow_inf=True)
        if self.repair_hours is not None:
            _require("repair_hours", self.repair_hours, positive=False)
        if self.checkpoint_interval_hours is None and self.checkpoint_save_seconds == 0 \
                and math.isfinite(self.job_mtbf_hours):
            raise SimConfigError("checkpoint_save_seconds is 0, so the Young/Daly interval is 0: "
                                 "set checkpoint_interval_hours explicitly")
        if self.failure_times_hours is not None:
            times = self.failure_times_hours
            if any(not math.isfinite(t) or t < 0 for t in times) or list(times) != sorted(times):
                raise SimConfigError("failure_times_hours must be finite, >= 0 and sorted ascending")

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def iteration_hours(self) -> float:
        return self.iteration_seconds / 3600.0

    @property
    def nominal_tokens_per_hour(self) -> float:
        """Throughput of the failure-free job at its configured size."""
        return self.tokens_per_iteration / self.iteration_hours

    @property
    def elastic(self) -> bool:
        """Broken replicas can be re-formed: healthy GPUs of a broken replica then wait as spares."""
        return self.spare_gpus > 0 or self.repair_hours is not None

    @property
    def job_mtbf_hours(self) -> float:
        """Mean time between failures of the whole job (inf when there are none)."""
        if self.failure_times_hours is not None:
            count = len(self.failure_times_hours)
            return self.run_hours / count if count else math.inf
        if self.gpu_mtbf_hours is None:
            return math.inf
        return self.gpu_mtbf_hours / self.gpus

    @property
    def restart_total_hours(self) -> float:
        """R of the closed form: relaunch plus checkpoint load."""
        return (self.restart_seconds + self.checkpoint_load_seconds) / 3600.0

    @property
    def interval_hours(self) -> float:
        """Compute time between checkpoints: the configured one or Young/Daly sqrt(2 * save * MTBF)."""
        if self.checkpoint_interval_hours is not None:
            return self.checkpoint_interval_hours
        return math.sqrt(2.0 * self.checkpoint_save_seconds / 3600.0 * self.job_mtbf_hours)


def _require(name: str, value: float, positive: bool, allow_inf: bool = False) -> None:
    ok_number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not ok_number or (math.isinf(value) and not allow_inf):
        raise SimConfigError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise SimConfigError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
