"""Typed configuration of the model, the optimizer and the learning-rate schedule: the one
conversion of the validated flags (argparse's Namespace: the Megatron-compatible surface) into
frozen dataclasses, each checked where it is declared. The builders (`model.py`,
`optimizer/setup.py`) take these and never read the Namespace; megatron-core's own
`TransformerConfig` and `OptimizerConfig` are reused where they fit.

Built once by the entry point after the flags were validated (`from_args`); tests build them the
same way from a parsed command line.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron.training.config.batch import BatchSchedule
from megatron.training.config.attention import attention_fields, mla_fields
from megatron.training.config.moe import moe_fields
from megatron.training.profiling import ProfilingConfig
from megatron.training.rerun import RerunConfig
from megatron.training.straggler import StragglerConfig
from megatron.training.config.rules import (model_chunks_of, position_embedding_type_of,
                                            layers_of, node_size_of, shards_parameters,
                                            recompute_granularity_of, recomputed_modules)

IMPLEMENTATIONS = ("local", "transformer_engine")
DEVICES = ("cpu", "cuda")


def params_dtype_of(args: argparse.Namespace) -> torch.dtype:
    """The training dtype the precision flags ask for (Megatron's `params_dtype`)."""
    return torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float


@dataclass(frozen=True)
class RunLayout:
    """Where this process runs, derived once from the launcher's environment and the flags: the
    values Megatron-LM's checks write into its args (they stay out of ours)."""
    world_size: int
    rank: int
    local_rank: int  # its GPU on the node: the launcher's LOCAL_RANK wins over --local-rank
    data_parallel_size: int  # replicas: world / (TP x PP x CP)
    device: str
    node_size: int  # ranks per node: a node's loss takes them together (design.md §3)

    def __post_init__(self):
        if self.device not in DEVICES or not 0 <= self.rank < self.world_size:
            raise ValueError(f"device {self.device!r}, rank {self.rank} of {self.world_size}")
        if not 1 <= self.node_size <= self.world_size:
            raise ValueError(f"{self.node_size} ranks per node in a world of {self.world_size}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int, device: str,
                  environ: Mapping[str, str] = os.environ) -> RunLayout:
        local = environ.get("LOCAL_RANK")
        return cls(world_size, int(environ.get("RANK", "0")),
                   int(local) if local is not None else (args.local_rank or 0),
                   world_size // (args.tensor_model_parallel_size
                                  * args.pipeline_model_parallel_size
                                  * args.context_parallel_size), device,
                   node_size_of(environ, world_size))

    def megatron_fields(self, args: argparse.Namespace) -> dict:
        """What Megatron-LM's checks write into its args and ours leave out: the layout and the
        settings derived from several flags (its checkpoints store them in `args`)."""
        return {"world_size": self.world_size, "rank": self.rank, "local_rank": self.local_rank,
                "data_parallel_size": self.data_parallel_size, "device": self.device,
                "params_dtype": params_dtype_of(args),
                "num_microbatches_per_iteration": args.global_batch_size // args.micro_batch_size,
                "virtual_pipeline_model_parallel_size": model_chunks_of(args),
                "recompute_granularity": recompute_granularity_of(args),
                "accumulate_allreduce_grads_in_fp32": True}
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass(frozen=True)
class ModelConfig:
    """One rank's GPT: megatron-core's TransformerConfig plus what GPTModel takes beside it."""
    transformer: TransformerConfig
    implementation: str  # the layer spec: ReCoVer's CPU-capable local one or transformer-engine's
    padded_vocab_size: int  # the tokenizer's, padded as Megatron pads it (divisible by TP)
    seq_length: int
    max_sequence_length: int  # --max-position-embeddings
    share_embeddings: bool  # not --untie-embeddings-and-output-weights
    position_embedding_type: str
    rotary_percent: float
    rotary_base: int
    rope_scaling: bool  # --use-rope-scaling (Llama 3.x frequencies)
    rope_scaling_factor: float
    rope_interpolation: int | None  # --rotary-seq-len-interpolation-factor
    seed: int  # parameters are drawn by global name from it

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation {self.implementation!r} not in {IMPLEMENTATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"position embedding {self.position_embedding_type!r} not in "
                             f"{POSITION_EMBEDDINGS}")
        if self.padded_vocab_size % self.transformer.tensor_model_parallel_size:
            raise ValueError(f"padded vocabulary {self.padded_vocab_size} does not split over "
                             f"{self.transformer.tensor_model_parallel_size} TP ranks")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary percent {self.rotary_percent} not in (0, 1]")

    @classmethod
    def from_args(cls, args: argparse.Namespace, padded_vocab_size: int) -> ModelConfig:
        return cls(transformer=transformer_config(args), implementation=layers_of(args),
                   padded_vocab_size=padded_vocab_size, seq_length=args.seq_length,
                   max_sequence_length=args.max_position_embeddings,
                   share_embeddings=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=position_embedding_type_of(args),
                   rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                   rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                   rope_interpolation=args.rotary_seq_len_interpolation_factor, seed=args.seed)

    @property
    def model_chunks(self) -> int | None:
        """Model chunks per pipeline rank (the interleaved schedule), None without."""
        return self.transformer.virtual_pipeline_model_parallel_size


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    # multi-latent attention: megatron-core's config of it, as Megatron-LM picks the class
    mla = args.multi_latent_attention
    return (MLATransformerConfig if mla else TransformerConfig)(
        **(mla_fields(args) if mla else {}),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        # one value (the checks let no other through with CP): megatron-core hands it to each
        # layer's core attention, which picks ReCoVer's exchange of that kind
        cp_comm_type=args.cp_comm_type[0],
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        virtual_pipeline_model_parallel_size=model_chunks_of(args),
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        sequence_parallel=args.sequence_parallel,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        **attention_fields(args),
        add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu or args.quick_geglu,
        activation_func=activation_of(args),
        glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value,
        rotary_interleaved=args.rotary_interleaved,
        deterministic_mode=args.deterministic_mode,
        # megatron-core's recompute saves and restores the RNG states (our tracker's included), so
        # a recomputed forward draws the same dropout masks
        recompute_granularity=recompute_granularity_of(args),
        recompute_method=args.recompute_method,
        recompute_modules=recomputed_modules(args),
        recompute_num_layers=args.recompute_num_layers if args.recompute_method else None,
        # Initialised on the CPU (Megatron's --use-cpu-initialization) on every device, then moved:
        # `init_parameters_by_name` draws every tensor on the CPU anyway, which keeps a GPU run's
        # weights identical to a CPU run's.
        use_cpu_initialization=True,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype_of(args),
        pipeline_dtype=params_dtype_of(args),
        **_kernels(args),
        layernorm_epsilon=args.layernorm_epsilon,
        add_qkv_bias=args.add_qkv_bias or args.add_bias_linear,  # as Megatron-LM keeps them
        # Gradients accumulate into ReCoVer's main-grad buffer by a hook (recovery/grad_buffer).
        gradient_accumulation_fusion=False,
        **moe_fields(args),
    )


def _kernels(args: argparse.Namespace) -> dict:
    """Kernel choices. The fused ones are CUDA-only (forced off on CPU by the argument checks)."""
    return dict(
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion,
        apply_rope_fusion=args.rope_fusion,
        persist_layer_norm=not args.no_persist_layer_norm,  # transformer-engine's kernel only
        disable_bf16_reduced_precision_matmul=args.disable_bf16_reduced_precision_matmul,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,  # read by step.parts
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl)


def activation_of(args: argparse.Namespace) -> Callable:
    """The MLP's activation, as Megatron-LM picks it (megatron-core's functions)."""
    if args.squared_relu:
        return squared_relu
    if args.quick_geglu:
        return quick_gelu
    return F.silu if args.swiglu else F.gelu


@dataclass(frozen=True)
class OptimizerSetup:
    """Which optimizer runs and how: megatron-core's OptimizerConfig (Adam's hyper-parameters,
    clipping, fp16's loss scale, the distributed optimizer) plus the gradient buckets."""
    adam: OptimizerConfig
    instances: int  # --num-distributed-optimizer-instances
    bucket_size: int | None  # --ddp-bucket-size
    overlap_grad_reduce: bool

    def __post_init__(self):
        if self.instances < 1:
            raise ValueError(f"{self.instances} distributed optimizer instances: at least 1")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket size {self.bucket_size}: at least 1 parameter")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OptimizerSetup:
        adam = OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
            weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
            # megatron-core's standard parameter groups carry both out (wd_mult, max/min lr)
            apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
            decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr)
        return cls(adam, args.num_distributed_optimizer_instances, args.ddp_bucket_size,
                   args.overlap_grad_reduce)


@dataclass(frozen=True)
class ScheduleConfig:
    """megatron-core's OptimizerParamScheduler in samples (Megatron steps it by the global batch
    each iteration): every step count already converted from iterations where flags gave them."""
    init_lr: float
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str
    use_checkpoint_scheduler: bool  # --use-checkpoint-opt_param-scheduler
    override_scheduler: bool  # --override-opt_param-scheduler
    wsd_decay_steps: int | None = None  # --lr-decay-style WSD: the annealing phase, in samples
    wsd_decay_style: str = "exponential"  # --lr-wsd-decay-style

    def __post_init__(self):
        if min(self.warmup_steps, self.decay_steps, self.wd_incr_steps) < 0:
            raise ValueError(f"negative step count: warm-up {self.warmup_steps}, decay "
                             f"{self.decay_steps}, weight-decay increment {self.wd_incr_steps}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScheduleConfig:
        gbs = args.global_batch_size
        # Megatron picks the branch by the flag the user gave: the checks derive --train-iters
        # from --train-samples, and the sample-based flags must still count then
        if args.train_samples is None:
            decay = (args.lr_decay_iters or args.train_iters) * gbs
            wd_incr = args.train_iters * gbs
            wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
            warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                      else args.lr_warmup_iters * gbs)
        else:
            decay = args.lr_decay_samples or args.train_samples
            wd_incr = args.train_samples
            wsd = args.lr_wsd_decay_samples
            warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                      else args.lr_warmup_samples)
        wd = args.weight_decay
        return cls(init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
                   warmup_steps=int(warmup), decay_steps=int(decay),
                   decay_style=args.lr_decay_style,
                   start_wd=wd if args.start_weight_decay is None else args.start_weight_decay,
                   end_wd=wd if args.end_weight_decay is None else args.end_weight_decay,
                   wd_incr_steps=int(wd_incr), wd_incr_style=args.weight_decay_incr_style,
                   use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler,
                   override_scheduler=args.override_opt_param_scheduler,
                   wsd_decay_steps=wsd, wsd_decay_style=args.lr_wsd_decay_style)


@dataclass(frozen=True)
class TrainingConfig:
    """What the training loop reads: its length, evaluation, logging, collection and how many
    replicas it needs to go on."""
    batches: BatchSchedule
    train_iters: int
    eval_interval: int | None
    eval_iters: int
    log_interval: int
    log_throughput: bool
    log_memory: bool  # --log-memory-to-tensorboard: every rank records it
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    min_replicas: int  # --recover-min-replicas
    # one distributed-optimizer instance or Megatron-FSDP shard group, whose state dies with a
    # replica: why ("" when K >= 2)
    one_optimizer_copy: str
    profiling: ProfilingConfig = ProfilingConfig()  # --profile
    straggler: StragglerConfig = StragglerConfig()  # --log-straggler

    def __post_init__(self):
        if self.train_iters < 0 or self.log_interval < 1 or self.min_replicas < 0:
            raise ValueError(f"train iterations {self.train_iters}, log interval "
                             f"{self.log_interval}, min replicas {self.min_replicas}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingConfig:
        return cls(BatchSchedule.from_args(args), args.train_iters, args.eval_interval,
                   args.eval_iters, args.log_interval, bool(args.log_throughput),
                   bool(args.log_memory_to_tensorboard), bool(args.manual_gc),
                   args.manual_gc_interval, bool(args.manual_gc_eval), args.recover_min_replicas,
                   one_copy_reason(args),
                   ProfilingConfig.from_args(args), StragglerConfig.from_args(args))


@dataclass(frozen=True)
class StepConfig:
    """What a replica's step reads of the flags, fixed after validation."""
    drop_lost: bool  # --recover-policy drop: each replica keeps its failure-free share
    even_balance: bool  # --recover-balance even
    chunks: int  # model chunks per rank (virtual pipeline)
    vp_group: int  # --microbatch-group-size-per-virtual-pipeline-stage (0: no model chunks)
    overlap_warmup_flush: bool
    weight_check_interval: int
    clip_grad: float
    log_num_zeros: bool
    log_params_norm: bool
    micro_batch_size: int
    overlap_param_gather: bool
    recovering: bool  # recovery on: a failed weight all-gather after the step is recovered
    empty_cache_level: int = 0  # --empty-unused-memory-level (a GPU's cached memory)
    exact_reduction: bool = False  # --recover-exact-reduction: fixed-point gradients, exact norm
    rerun: RerunConfig = RerunConfig("disabled", 0, "transient_error", None)  # --rerun-mode

    @classmethod
    def from_args(cls, args: argparse.Namespace, recovering: bool) -> StepConfig:
        return cls(drop_lost=args.recover_policy == "drop",
                   even_balance=args.recover_balance == "even",
                   chunks=model_chunks_of(args) or 1,
                   vp_group=args.microbatch_group_size_per_vp_stage or 0,
                   overlap_warmup_flush=bool(args.overlap_p2p_comm_warmup_flush),
                   weight_check_interval=args.check_weight_hash_across_dp_replicas_interval
                   or (1 if args.test_mode else 0),  # --test-mode: every iteration
                   clip_grad=args.clip_grad, log_num_zeros=bool(args.log_num_zeros_in_grad),
                   log_params_norm=bool(args.log_params_norm),
                   micro_batch_size=args.micro_batch_size,
                   overlap_param_gather=bool(args.overlap_param_gather), recovering=recovering,
                   empty_cache_level=args.empty_unused_memory_level,
                   exact_reduction=bool(args.recover_exact_reduction),
                   rerun=RerunConfig(args.rerun_mode, args.error_injection_rate,
                                     args.error_injection_type,
                                     args.result_rejected_tracker_filename,
                                     bool(args.check_for_spiky_loss),
                                     bool(args.check_for_large_grads)))


def one_copy_reason(args: argparse.Namespace) -> str:
    """Why one lost replica ends the job, or "": the only copy of the state is sharded over all."""
    if not args.use_distributed_optimizer or args.num_distributed_optimizer_instances > 1:
        return ""
    if shards_parameters(args):
        return ("--use-megatron-fsdp with --num-distributed-optimizer-instances 1 is one shard "
                "group, holding the only copy of the parameters: K >= 2 groups survive a lost one")
    return ("--use-distributed-optimizer with --num-distributed-optimizer-instances 1 keeps one "
            "copy of the optimizer state: K >= 2 survives a lost replica")
