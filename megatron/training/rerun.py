"""Megatron-LM's rerun state machine, the ReCoVer way (`--rerun-mode validate_results`).

Megatron re-runs a suspicious iteration on the same GPU, then after a restart on another, to tell
a faulty GPU from a real problem in the data. Here any replica can compute any microbatch, so the
second opinion comes at once, inside the iteration:

1. Each replica's alarm -- its own loss sum is not finite -- rides in the reduction, one slot per
   replica, so after it every rank knows the suspects; no alarm ends the check. Only the last
   stage holds the loss: with PP > 1 it tells its replica's other stages first (a one-element
   all-reduce inside the replica, before the reduction).
2. Suspects: the lowest other live replica re-computes their microbatches (its gradients are
   put back afterwards: the re-run is for its loss only).
3. The re-run's loss is finite: the suspects' results are rejected. Their ranks are fenced --
   they exit like dead ranks (`ResultRejected`, status 1) -- and the others recover as from any
   failure: the suspects' microbatches are recomputed by survivors in the same iteration, so the
   loss curve is the failure-free one. The same loss again: the data or the model is at fault,
   not a rank, and the job stops on every rank (`ResultReproduced`, status 3) as Megatron does.
   With one live replica the re-run runs on it; a result that does not repeat stops the job
   for a restart (status 3) since no other replica can take over.

`--error-injection-rate N` / `--error-injection-type` drive it: at every N-th iteration the
replica (iteration / N) mod DP makes its loss NaN. transient_error and persistent_error (Megatron:
reproducible on the same GPU, not on another) are wrong only where they were injected, so the
replica is fenced; correct_result follows the microbatches, so the re-run repeats it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from recover_patches.collectives import PeerFailure

logger = logging.getLogger(__name__)

MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


class ResultRejected(RuntimeError):
    """This rank's replica computed a loss another replica did not reproduce: it is fenced."""


class ResultReproduced(RuntimeError):
    """A non-finite loss repeated on another replica (or could not be told apart): stop."""


@dataclass(frozen=True)
class RerunConfig:
    mode: str  # --rerun-mode
    injection_rate: int  # --error-injection-rate (0: none)
    injection_type: str  # --error-injection-type
    tracker: str | None  # --result-rejected-tracker-filename

    def __post_init__(self):
        if self.mode not in MODES or self.injection_type not in INJECTION_TYPES \
                or self.injection_rate < 0:
            raise ValueError(f"rerun mode {self.mode!r}, injection {self.injection_type!r} "
                             f"every {self.injection_rate}")

    @property
    def validating(self) -> bool:
        return self.mode == "validate_results"

    def injects(self, iteration: int, replica: int, replicas: int) -> bool:
        """This replica corrupts its loss in `iteration` (the same answer on every rank)."""
        rate = self.injection_rate
        return rate > 0 and iteration % rate == 0 and (iteration // rate) % replicas == replica


@dataclass(frozen=True)
class Position:
    """Where the check runs: this rank's replica and the iteration's membership."""
    iteration: int
    replica: int
    live_replicas: tuple[int, ...]
    replicas: int  # all replicas of the layout (DP): the length of per-replica vectors
    epoch: int
    is_last_stage: bool  # holds the loss


class RerunHost(Protocol):
    """What the check needs of this rank's replica step."""

    def rerun(self, ids: list[int]) -> Any:
        """This replica's loss sum over `ids` (last stage), its gradients left as they were."""

    def share(self, values: list[float]) -> list[float]:
        """Sum over the replicas at this rank's position, then the largest over the replica."""

    def ranks_of(self, replica: int) -> list[int]: ...


def _finite(loss: Any) -> bool:
    return bool(torch.isfinite(torch.as_tensor(loss)).all())


def _nan(loss: Any) -> Any:
    return torch.as_tensor(loss, dtype=torch.float64) * math.nan


def resolve(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
            assignment: dict[int, list[int]]) -> None:
    """`suspects`: the replicas whose own loss was not finite. Re-run their microbatches on
    another replica and raise the verdict (every rank reaches the same one)."""
    others = [r for r in at.live_replicas if r not in suspects]
    validator = min(others) if others else min(at.live_replicas)
    ids = sorted(g for r in suspects for g in assignment.get(r, []))
    verdict = [0.0, 0.0]  # [re-run finite, re-run not finite], from the validator's last stage
    if at.replica == validator:
        loss = host.rerun(ids)
        if config.injection_type == "correct_result" and any(
                config.injects(at.iteration, r, at.replicas) for r in suspects):
            loss = _nan(loss)  # an injected "correct result" follows its microbatches
        if at.is_last_stage:
            verdict = [1.0, 0.0] if _finite(loss) else [0.0, 1.0]
    repeated = host.share(verdict)[1] > 0
    what = (f"iteration {at.iteration}: replica(s) {suspects} computed a non-finite loss over "
            f"microbatches {ids}; re-run on replica {validator}: ")
    if repeated:
        raise ResultReproduced(what + "the same again, so the data or the model is at fault, "
                                      "not a rank")
    if not others:
        raise ResultReproduced(what + "finite, but no other replica can take over from the "
                                      "only live one")
    fenced = sorted(rank for r in suspects for rank in host.ranks_of(r))
    logger.warning(what + f"finite: the result is rejected and ranks {fenced} are fenced")
    if config.tracker and at.replica == validator and at.is_last_stage:
        with open(config.tracker, "a") as f:
            f.write(f"iteration {at.iteration} replicas {suspects} ranks {fenced} microbatches "
                    f"{ids}: non-finite loss, finite on replica {validator}\n")
    if at.replica in suspects:
        raise ResultRejected(what + f"finite: this replica's result is rejected, rank(s) "
                                    f"{fenced} are fenced")
    raise PeerFailure(at.epoch, fenced, "rerun.validate", "a result was rejected")


def injected(loss: Any, config: RerunConfig, iteration: int, replica: int,
             replicas: int) -> Any:
    """The loss of a replica's first computation in `iteration`, with --error-injection-*'s
    corruption applied when one is due there."""
    if not config.injects(iteration, replica, replicas):
        return loss
    logger.warning(f"iteration {iteration}: injecting a {config.injection_type} into replica "
                   f"{replica}'s loss (--error-injection-rate)")
    return _nan(loss)
