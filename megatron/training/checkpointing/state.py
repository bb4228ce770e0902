"""What one rank's checkpoint holds and how it is applied: Megatron's keys (args,
checkpoint_version, iteration, model, optimizer, opt_param_scheduler, rng_state) plus ReCoVer's
records, in the torch format's shape; torch_dist checkpoints are brought into the same shape
(`checkpointing.torch_dist`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing.format import (CHECKPOINT_VERSION, FORMAT, GRAD_EXPONENTS,
                                                    CheckpointError, with_megatron_args)
from megatron.training.config.io import CheckpointConfig
from megatron.training.initialize import ParallelGroups
from megatron.training.model import checkpoint_keys, model_chunks
from megatron.training.optimizer import Optimizer
from recover_patches.recovery.fixed_point import FixedPointScales


@dataclass
class Progress:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0  # fp16 overflows: no optimizer step (Megatron's log line counts them)


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds and a joining replica receives, as the trainer owns it: the
    model, its optimizer and schedule, the progress counters (shared: loading one updates the
    trainer's), and the groups and device that place this rank."""
    model: torch.nn.Module
    optimizer: Optimizer
    scheduler: OptimizerParamScheduler
    progress: Progress
    groups: ParallelGroups
    device: torch.device
    grad_scales: FixedPointScales | None = None  # --recover-exact-reduction's exponents


class Faults(Protocol):
    def at(self, phase: str, iteration: int, microbatch: int | None = None) -> None:
        """Fault injection point (`recover_patches.faults`)."""
        ...


class CheckpointHost(Protocol):
    """What checkpoints need of the running job (the Trainer): its state, who is live, the
    job-wide meeting points (resilient when recovery is on), and the hooks around a save."""
    @property
    def training_state(self) -> TrainingState: ...

    @property
    def live_replicas(self) -> list[int]: ...

    @property
    def membership_epoch(self) -> int:
        """The last membership epoch all live ranks agreed (a failure or a join starts one)."""
        ...

    @property
    def faults(self) -> Faults: ...

    def barrier(self, key: str) -> None:
        """All ranks of the live replicas meet (PeerFailure if one dies meanwhile)."""
        ...

    def any_rank(self, flag: bool, key: str) -> bool:
        """True on every live rank iff any of them passes True."""
        ...

    def weights_ready(self) -> None:
        """Overlapped weight all-gathers land before the weights are read."""
        ...

    def close_metrics(self) -> None: ...


def cpu_tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return get_cuda_rng_tracker()  # recover_patches.pipeline.rng installs its device tracker in its place


def rng_state() -> dict:
    return {"torch_cpu": torch.get_rng_state(), "tracker": cpu_tracker().get_states()}


def rank_state(training: TrainingState, config: CheckpointConfig,
               optimizer_state: dict | None = None) -> dict:
    """The torch format's file: Megatron's keys (args, checkpoint_version, iteration, model,
    optimizer, opt_param_scheduler, rng_state) plus ReCoVer's records."""
    topo, coord = training.groups.topology, training.groups.coord
    state = {
        "args": with_megatron_args(config.megatron_args, training.progress.iteration,
                                       training.progress.consumed_samples),
        "checkpoint_version": CHECKPOINT_VERSION,
        "format": FORMAT, "iteration": training.progress.iteration,
        "consumed_samples": training.progress.consumed_samples,
        "topology": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "world_size": topo.world_size},
        "coord": {"rank": training.groups.rank, "tp": coord.tp, "pp": coord.pp, "replica": coord.replica},
        **{key: chunk.state_dict() for key, chunk in zip(checkpoint_keys(training.model),
                                                          model_chunks(training.model))},
    }
    if config.save_optim:
        state["optimizer"] = (training.optimizer.state_dict() if optimizer_state is None
                              else optimizer_state)
        state["opt_param_scheduler"] = training.scheduler.state_dict()
    if config.save_rng:  # (and the exact reduction's exponents, per position like the RNG)
        state["rng_state"] = {**rng_state(), **({} if training.grad_scales is None else {
            GRAD_EXPONENTS: training.grad_scales.state_dict()})}
    return state


def from_stock_megatron(state: dict) -> dict:
    """A stock Megatron-LM torch file in `apply_rank_state`'s shape: its consumed samples are in
    its args, its fp32 main weights a list per param group, its RNG not ours (not restored)."""
    state = dict(state)
    state.setdefault("consumed_samples", getattr(state.get("args"), "consumed_train_samples", 0))
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("fp32_from_fp16_params") and \
            isinstance(optimizer["fp32_from_fp16_params"][0], list):
        optimizer["fp32_from_fp16_params"] = [t for g in optimizer["fp32_from_fp16_params"] for t in g]
    state.pop("rng_state", None)
    return state


def apply_rank_state(training: TrainingState, state: dict, config: CheckpointConfig) -> None:
    """Weights always; optimizer, schedule, RNG and progress unless --finetune / --no-load-*.
    Dropout is reseeded per microbatch (recover_patches.pipeline.rng), so exact resume needs the iteration
    and consumed samples; the RNG streams are restored for anything else drawing from them."""
    for key, chunk in zip(checkpoint_keys(training.model), model_chunks(training.model)):
        chunk.load_state_dict(state[key], strict=True)
    if config.finetune or not config.load_optim:
        training.optimizer.reload_model_params()  # bf16/fp16: main params follow
    if config.finetune:
        return
    training.progress.iteration = state["iteration"]
    training.progress.consumed_samples = state["consumed_samples"]
    if config.load_optim:
        training.optimizer.load_state_dict(state["optimizer"])
        try:
            training.scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as err:  # megatron-core refuses a changed LR schedule this way
            raise CheckpointError(
                "--load", f"the LR schedule flags differ from the checkpoint's ({err})",
                "pass the checkpoint's --lr/--min-lr/decay/warmup/--train-iters values, or "
                "--use-checkpoint-opt_param-scheduler to take its schedule, or "
                "--override-opt_param-scheduler to keep yours") from None
    if config.load_rng and "rng_state" in state:  # absent: see load_rank_state
        torch.set_rng_state(state["rng_state"]["torch_cpu"])
        cpu_tracker().set_states(state["rng_state"]["tracker"])
        exponents = state["rng_state"].get(GRAD_EXPONENTS)
        if training.grad_scales is not None and exponents is not None:  # else: measured afresh
            training.grad_scales.load_state_dict(exponents)
