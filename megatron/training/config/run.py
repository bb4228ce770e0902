"""The run's one configuration: a frozen root built once, after the flags were validated and the
tokenizer said how large the vocabulary is. The entry point and every builder read it; Megatron's
Namespace goes on only as the checkpoint's `args` blob (`CheckpointConfig.megatron_args`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.training.config import (ModelConfig, OptimizerSetup, RunLayout, ScheduleConfig,
                                      StepConfig, TrainingConfig)
from megatron.training.config.io import (CheckpointConfig, DataConfig, FtConfig, TensorBoardConfig,
                                         TokenizerConfig, WandbConfig)
from megatron.training.config.rules import megatron_differences, model_chunks_of, shards_parameters
from recover_patches.placement import Nodes, placed
from recover_patches.topology import Topology


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the job and how their groups are made."""
    tensor: int
    pipeline: int
    context: int
    expert: int
    tp_pp_dp_mapping: bool  # --use-tp-pp-dp-mapping: Megatron's other rank order
    placement: str  # --recover-placement: may order the ranks so replicas sit on disjoint nodes
    node_size: int  # ranks per node, where the placement looks
    optimizer_instances: int | None  # --num-distributed-optimizer-instances; None: no sharding
    shards_parameters: bool  # Megatron-FSDP's optim_grads_params: the instances are shard groups
    model_chunks: bool  # the interleaved schedule: a p2p channel per chunk direction
    backend: str  # --distributed-backend (the default group's, without recovery)
    startup_seconds: float  # --distributed-timeout-minutes: connects and the first iteration
    deterministic: bool  # --deterministic-mode
    seed: int

    def __post_init__(self):
        if min(self.tensor, self.pipeline, self.context, self.expert) < 1:
            raise ValueError(f"parallel sizes {self}: each at least 1")
        if self.shards_parameters and self.optimizer_instances is None:
            raise ValueError("sharded parameters (Megatron-FSDP) live in the distributed "
                             "optimizer's instances")

    @classmethod
    def from_args(cls, args: argparse.Namespace, node_size: int) -> ParallelConfig:
        return cls(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                   args.context_parallel_size, args.expert_model_parallel_size,
                   bool(args.use_tp_pp_dp_mapping), args.recover_placement, node_size,
                   args.num_distributed_optimizer_instances if args.use_distributed_optimizer
                   else None, shards_parameters(args), model_chunks_of(args) is not None, args.distributed_backend,
                   60.0 * args.distributed_timeout_minutes, bool(args.deterministic_mode),
                   args.seed)

    def asked_topology(self, world_size: int) -> Topology:
        """The layout in the rank order the Megatron flags name."""
        return Topology.from_world(world_size, self.tensor, self.pipeline, self.tp_pp_dp_mapping,
                                   cp=self.context, ep=self.expert,
                                   shard_groups=self.optimizer_instances
                                   if self.shards_parameters else None)

    def nodes(self, world_size: int, switches: tuple[str, ...] = ()) -> Nodes:
        return Nodes(min(self.node_size, world_size), world_size, switches)

    def topology(self, world_size: int) -> Topology:
        """Where each rank of a job of `world_size` sits: its replica, stage and groups, in the
        order the placement chose for the nodes."""
        return placed(self.asked_topology(world_size), self.nodes(world_size), self.placement)


@dataclass(frozen=True)
class FaultTolerance:
    """In-job recovery and what bounds it: the coordinator, T, spares, injected faults."""
    recover: bool  # --recover on
    spares: bool  # --recover-spares on: a broken replica's ranks wait to re-form it
    timeout: float  # --recover-timeout T
    inject_fault: tuple[str, ...]  # --inject-fault specs
    ft: FtConfig  # Megatron's fault-tolerance flags (--calc-ft-timeouts)

    def __post_init__(self):
        if self.timeout <= 0:
            raise ValueError(f"--recover-timeout {self.timeout}: more than 0 seconds")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultTolerance:
        return cls(bool(args.recover), bool(args.recover_spares), float(args.recover_timeout),
                   tuple(args.inject_fault), FtConfig.from_args(args))


@dataclass(frozen=True)
class RunConfig:
    """Everything the run reads of its flags, typed and checked where each part is declared."""
    layout: RunLayout
    parallel: ParallelConfig
    fault_tolerance: FaultTolerance
    model: ModelConfig
    optimizer: OptimizerSetup
    schedule: ScheduleConfig
    training: TrainingConfig
    step: StepConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    tensorboard: TensorBoardConfig | None
    wandb: WandbConfig | None
    metrics_file: str | None
    restart_from: str  # the checkpoint a stopped job restarts from, as its last line says
    megatron_notes: tuple[str, ...]  # start-up lines: where this run differs from Megatron-LM

    @classmethod
    def from_args(cls, args: argparse.Namespace, layout: RunLayout, padded_vocab_size: int,
                  recovering: bool) -> RunConfig:
        """`recovering`: in-job recovery is on and a coordinator is there to run it."""
        return cls(
            layout, ParallelConfig.from_args(args, layout.node_size), FaultTolerance.from_args(args),
            ModelConfig.from_args(args, padded_vocab_size), OptimizerSetup.from_args(args),
            ScheduleConfig.from_args(args), TrainingConfig.from_args(args),
            StepConfig.from_args(args, recovering=recovering), DataConfig.from_args(args),
            TokenizerConfig.from_args(args),
            CheckpointConfig.from_args(args, padded_vocab_size, layout),
            TensorBoardConfig.from_args(args), WandbConfig.from_args(args), args.metrics_file,
            args.load or args.save or "(no checkpoint: --save was not set)",
            tuple(megatron_differences(args, layout.device)))
