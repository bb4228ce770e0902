"""Megatron-LM's rerun state machine, the ReCoVer way (`--rerun-mode validate_results`).

Megatron re-runs a suspicious iteration on the same GPU, then after a restart on another, to tell
a faulty GPU from a real problem in the data. Here any replica can compute any microbatch, so the
second opinion comes at once, inside the iteration:

1. Each replica's alarm -- its own loss sum is not finite, or (--check-for-spiky-loss) its loss
   per token is 10 x the largest of its first 100 -- rides in the reduction, one slot per
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
   A spiky loss is judged by its value: a re-run that repeats the suspects' loss sum (relative
   1e-6) means the data spikes, and training goes on (Megatron-LM's spike check is not fatal);
   another value rejects and fences them as above. --check-for-large-grads is judged alike on
   each (tp, pp) position's gradient norm (relative 1e-3, Megatron's tolerance).

`--error-injection-rate N` / `--error-injection-type` drive it: at every N-th iteration the
replica (iteration / N) mod DP makes its loss NaN (with --check-for-spiky-loss: 1000 x; with
only --check-for-large-grads its gradients 1000 x: the check under test). transient_error and persistent_error (Megatron:
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
SPIKY_LOSS_FACTOR = 10.0  # Megatron-LM's pretrain_gpt.py: a loss 10 x the largest seen is spiky
SPIKE_SAMPLES = 100  # Megatron's is_unexpectedly_large: the largest of the first 100 values
SPIKE_INJECTED = 1000.0  # --error-injection-* with --check-for-spiky-loss: the loss x this
SAME_LOSS = 1e-6  # relative: a re-run's loss sum repeats the suspect's (the summing order may
# differ; a spike is orders of magnitude off)
# a replica's alarm slot in the reduction (its stages share the largest: a non-finite loss first)
ALARM_SPIKY, ALARM_LARGE_GRADS, ALARM_NOT_FINITE = 1.0, 2.0, 3.0
LARGE_GRADS_FACTOR = 10.0  # Megatron's param_and_grad_buffer: 10 x the largest norm seen
SAME_GRADS = 1e-3  # Megatron's tolerance for the re-computed gradient norm
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
    spiky_loss: bool = False  # --check-for-spiky-loss (with validate_results)
    large_grads: bool = False  # --check-for-large-grads (with validate_results)

    def __post_init__(self):
        if self.mode not in MODES or self.injection_type not in INJECTION_TYPES \
                or self.injection_rate < 0:
            raise ValueError(f"rerun mode {self.mode!r}, injection {self.injection_type!r} "
                             f"every {self.injection_rate}")

    @property
    def validating(self) -> bool:
        return self.mode == "validate_results"

    @property
    def checks_spikes(self) -> bool:
        return self.validating and self.spiky_loss

    @property
    def checks_grads(self) -> bool:
        return self.validating and self.large_grads

    def corrupt(self, loss: Any) -> Any:
        """An injected error's loss: NaN; with --check-for-spiky-loss a spike; with only
        --check-for-large-grads unchanged (the gradients are amplified instead): the check it
        tests."""
        tensor = torch.as_tensor(loss, dtype=torch.float64)
        if self.checks_spikes:
            return tensor * SPIKE_INJECTED
        return tensor if self.checks_grads else tensor * math.nan

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
    slot: int = 0  # this rank's (tp, pp) position in its replica: tp + TP x pp
    slots: int = 1  # TP x PP
    unit: int = 1  # replicas per unit (expert parallelism)


class RerunHost(Protocol):
    """What the check needs of this rank's replica step."""

    def rerun(self, ids: list[int]) -> Any:
        """This replica's loss sum over `ids` (last stage), its gradients left as they were."""

    def rerun_gradient_norm(self, ids: list[int]) -> float:
        """The norm of this rank's gradients over `ids` alone; its gradients left as they were."""

    def share(self, values: list[float]) -> list[float]:
        """Sum over the replicas at this rank's position, then the largest over the replica."""

    def ranks_of(self, replica: int) -> list[int]: ...


def _finite(loss: Any) -> bool:
    return bool(torch.isfinite(torch.as_tensor(loss)).all())


def _validator(at: Position, suspects: list[int]) -> tuple[list[int], int]:
    """The live replicas that are not suspects, and the one that re-runs (itself, if none)."""
    if at.unit > 1:  # every rank gets here alike: all stop with this line
        raise RuntimeError(f"iteration {at.iteration}: replica(s) {suspects} raised a --rerun-mode "
                           "alarm, and a re-run on one replica is not built for "
                           "--expert-model-parallel-size > 1 or --use-megatron-fsdp (a unit of replicas "
                           "runs together): stopping")
    others = [r for r in at.live_replicas if r not in suspects]
    return others, min(others) if others else min(at.live_replicas)


def _rerun(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
           ids: list[int]) -> Any:
    """The validator's loss over `ids`; an injected "correct result" follows its microbatches."""
    loss = host.rerun(ids)
    if config.injection_type == "correct_result" and any(
            config.injects(at.iteration, r, at.replicas) for r in suspects):
        loss = config.corrupt(loss)
    return loss


def resolve(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
            assignment: dict[int, list[int]]) -> None:
    """`suspects`: the replicas whose own loss was not finite. Re-run their microbatches on
    another replica and raise the verdict (every rank reaches the same one)."""
    others, validator = _validator(at, suspects)
    ids = sorted(g for r in suspects for g in assignment.get(r, []))
    verdict = [0.0, 0.0]  # [re-run finite, re-run not finite], from the validator's last stage
    if at.replica == validator:
        loss = _rerun(host, config, at, suspects, ids)
        if at.is_last_stage:
            verdict = [1.0, 0.0] if _finite(loss) else [0.0, 1.0]
    repeated = host.share(verdict)[1] > 0
    what = (f"iteration {at.iteration}: replica(s) {suspects} computed a non-finite loss over "
            f"microbatches {ids}; re-run on replica {validator}: ")
    if repeated:
        raise ResultReproduced(what + "the same again, so the data or the model is at fault, "
                                      "not a rank")
    _reject(host, config, at, suspects, ids, validator, what + "finite", "non-finite loss")


def resolve_spike(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
                  assignment: dict[int, list[int]], own_loss: Any) -> None:
    """--check-for-spiky-loss: the suspects' own loss per token was 10 x the largest of their
    first 100. A re-run on another replica that repeats their loss sum means the data spikes:
    training goes on (Megatron-LM's check is not fatal); one that does not fences them."""
    others, validator = _validator(at, suspects)
    ids = sorted(g for r in suspects for g in assignment.get(r, []))
    verdict = [0.0, 0.0]  # [the re-run's loss sum, the suspects' own], from last stages
    if at.replica == validator:
        loss = _rerun(host, config, at, suspects, ids)
        if at.is_last_stage:
            verdict[0] = float(torch.as_tensor(loss))
    if at.replica in suspects and at.is_last_stage:
        verdict[1] = float(torch.as_tensor(own_loss))
    rerun, own = host.share(verdict)
    what = (f"iteration {at.iteration}: replica(s) {suspects} computed a spiky loss (sum "
            f"{own:.6g} over microbatches {ids}, {SPIKY_LOSS_FACTOR:g} x the largest seen); "
            f"re-run on replica {validator}: {rerun:.6g}")
    if math.isclose(rerun, own, rel_tol=SAME_LOSS):
        logger.warning(what + ", the same: the data spikes, not a rank; training goes on")
        return
    _reject(host, config, at, suspects, ids, validator, what, "spiky loss")


def resolve_large_grads(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
                        assignment: dict[int, list[int]], own_norm: float) -> None:
    """--check-for-large-grads: a suspect's gradient norm (on one of its ranks) was 10 x the
    largest of its first 100. For each suspect the validator re-computes its microbatches'
    gradients; every (tp, pp) position compares the two norms of its own shard (relative 1e-3,
    Megatron's tolerance). All the same: the data (training goes on); else the suspects whose
    norms differ are fenced."""
    _, validator = _validator(at, suspects)
    differing = []
    for suspect in suspects:
        ids = sorted(assignment.get(suspect, []))
        pairs = [0.0] * (2 * at.slots)  # per position: [the re-run's norm, the suspect's own]
        if at.replica == validator:
            pairs[2 * at.slot] = host.rerun_gradient_norm(ids)
        if at.replica == suspect:
            pairs[2 * at.slot + 1] = own_norm
        shared = host.share(pairs)
        if any(not math.isclose(shared[i], shared[i + 1], rel_tol=SAME_GRADS)
               for i in range(0, len(shared), 2)):
            differing.append(suspect)
    what = (f"iteration {at.iteration}: replica(s) {suspects} computed unexpectedly large "
            f"gradients ({LARGE_GRADS_FACTOR:g} x the largest norm seen); re-run on replica "
            f"{validator}: ")
    if not differing:
        logger.warning(what + "the same norms: the data, not a rank; training goes on")
        return
    ids = sorted(g for r in differing for g in assignment.get(r, []))
    _reject(host, config, at, differing, ids, validator,
            what + f"replica(s) {differing} differ", "large gradients")


def _reject(host: RerunHost, config: RerunConfig, at: Position, suspects: list[int],
            ids: list[int], validator: int, what: str, kind: str) -> None:
    """The suspects' result did not repeat: fence them (ResultRejected on their ranks, a
    PeerFailure that recovers on the others); with no other replica, stop (status 3)."""
    if validator in suspects:
        raise ResultReproduced(what + ", but no other replica can take over from the only "
                                      "live one")
    fenced = sorted(rank for r in suspects for rank in host.ranks_of(r))
    logger.warning(what + f": the result is rejected and ranks {fenced} are fenced")
    if config.tracker and at.replica == validator and at.is_last_stage:
        with open(config.tracker, "a") as f:
            f.write(f"iteration {at.iteration} replicas {suspects} ranks {fenced} microbatches "
                    f"{ids}: {kind}, not repeated on replica {validator}\n")
    if at.replica in suspects:
        raise ResultRejected(what + f": this replica's result is rejected, rank(s) "
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
    return config.corrupt(loss)


class SpikeDetector:
    """--check-for-spiky-loss on a last stage: this replica's own loss per token against
    SPIKY_LOSS_FACTOR x the largest of its first SPIKE_SAMPLES values (Megatron's rule, kept on
    the device: no host wait). Non-finite values are the other check's and never the largest."""

    def __init__(self) -> None:
        self.samples = 0
        self.largest: torch.Tensor | None = None

    def spiky(self, per_token: torch.Tensor) -> torch.Tensor:
        value = per_token.abs()
        finite = torch.isfinite(value)
        if self.samples < SPIKE_SAMPLES:
            sample = torch.where(finite, value, torch.zeros_like(value))
            self.largest = sample if self.largest is None else torch.maximum(self.largest, sample)
            self.samples += 1
            return torch.zeros_like(finite)
        assert self.largest is not None
        return finite & (value >= self.largest * SPIKY_LOSS_FACTOR)
