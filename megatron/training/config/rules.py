"""Megatron-LM's rules that give a setting from several flags, read alike by the argument checks
and by the typed configuration (`megatron.training.config`). Light on purpose: the checks run before anything
imports megatron-core or torch. Call them on validated flags."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from recover_patches.placement import Nodes, placed
from recover_patches.topology import Topology

GIVEN_AT_DEFAULT = "_megatron_default_"  # dest prefix of a refused flag given Megatron's default


def defaults_given(args: argparse.Namespace) -> list[str]:
    """`--flag value` of every refused flag the command line gave at Megatron-LM's default."""
    return sorted(" ".join(given) for dest, given in vars(args).items()
                  if dest.startswith(GIVEN_AT_DEFAULT))


def recompute_granularity_of(args: argparse.Namespace) -> str | None:
    """--recompute-activations means --recompute-granularity selective."""
    return "selective" if args.recompute_activations else args.recompute_granularity


RECOMPUTABLE = ("core_attn", "mlp", "moe", "shared_experts")  # megatron-core's, on any device
KEPT_IN_MEMORY = ("moe_act", "layernorm")  # recomputed only in TE's and grouped-GEMM modules


def recomputed_modules(args: argparse.Namespace) -> list[str] | None:
    """--recompute-modules as megatron-core takes it: those it recomputes in the modules run
    here (None: its default, core_attn)."""
    if args.recompute_modules is None:
        return None
    return [m for m in args.recompute_modules if m not in KEPT_IN_MEMORY]


def layers_to_split(args: argparse.Namespace) -> int:
    """The layers the pipeline split divides: the embedding and the loss count when asked."""
    return args.num_layers + int(args.account_for_embedding_in_pipeline_split) \
        + int(args.account_for_loss_in_pipeline_split)


def model_chunks_of(args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline rank (the interleaved schedule): --num-virtual-stages-per-
    pipeline-rank, or a stage's layers over --num-layers-per-virtual-pipeline-stage; None for one
    chunk, as Megatron-LM's virtual_pipeline_model_parallel_size."""
    chunks = args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None:
        chunks = layers_to_split(args) // args.pipeline_model_parallel_size \
            // args.num_layers_per_virtual_pipeline_stage
    return chunks if chunks is not None and chunks > 1 else None


NUM_WORKERS_DEFAULT = 2  # Megatron-LM's: a run that leaves it alone hears nothing of it


def position_embedding_type_of(args: argparse.Namespace) -> str:
    """--use-rotary-position-embeddings is Megatron-LM's older spelling of rope."""
    return "rope" if args.use_rotary_position_embeddings else args.position_embedding_type


def megatron_differences(args: argparse.Namespace, device: str) -> list[str]:
    """Where this run does not do what Megatron-LM would with the same flags, one line each
    naming the flag and why (said once at start-up). A flag that changes nothing says so."""
    chunks = model_chunks_of(args)
    lines = []
    if chunks is not None:
        lines.append(f"interleaved schedule: {chunks} model chunks per pipeline rank, "
                     f"microbatches in groups of {args.microbatch_group_size_per_vp_stage} (any "
                     "quota length runs)")
    elif not args.overlap_p2p_comm:
        lines.append("--no-overlap-p2p-communication has no effect without model chunks (as in "
                     "Megatron-LM: only the interleaved schedule overlaps its p2p)")
    if device == "cuda" and args.gradient_accumulation_fusion:
        lines.append("gradient accumulation fusion is off: gradients accumulate into ReCoVer's "
                     "fp32 main-grad buffer (pass --no-gradient-accumulation-fusion to silence "
                     "this)")
    if device == "cuda" and not args.use_cpu_initialization:
        lines.append("weights are initialised on the CPU, as with --use-cpu-initialization "
                     "(ReCoVer's only mode: every layout draws the same weights by name)")
    if args.fp16 and not args.accumulate_allreduce_grads_in_fp32:
        lines.append("gradients are accumulated and reduced in fp32, as with "
                     "--accumulate-allreduce-grads-in-fp32: ReCoVer's only mode")
    if args.eod_mask_loss and not args.calculate_per_token_loss:
        lines.append("the loss is averaged over the global batch's tokens, as with "
                     "--calculate-per-token-loss (ReCoVer's only mode: a recomputed microbatch "
                     "must weigh the same wherever it runs)")
    if args.ckpt_fully_parallel_save_deprecated:
        lines.append("--ckpt-fully-parallel-save changes nothing: the live replicas share the "
                     "writing by default (Megatron-LM deprecated the flag likewise)")
    if args.use_mcore_models:
        lines.append("--use-mcore-models changes nothing: megatron-core models are the only kind "
                     "(as in current Megatron-LM)")
    if args.profile and not args.use_pytorch_profiler and device != "cuda":
        lines.append("--profile without --use-pytorch-profiler marks a CUDA profiler range (for "
                     "nsys): nothing to mark on a CPU")
    if args.straggler_ctrlr_port != 65535:
        lines.append("--straggler-ctrlr-port has no effect: there is no straggler control server "
                     "(--log-straggler reports at every log line)")
    for flag, given in (("--openai-gelu", args.openai_gelu), ("--onnx-safe", args.onnx_safe)):
        if given:
            lines.append(f"{flag} changes nothing (current Megatron-LM reads it nowhere either)")
    if args.rope_type == "rope" and not args.multi_latent_attention:  # (yarn: MLA only)
        lines.append("--rope-type rope changes nothing: GPT attention's rope is rope (the type "
                     "matters to multi-latent attention only, as in Megatron-LM)")
    if args.use_flash_attn:
        lines.append("--use-flash-attn changes nothing (as in current Megatron-LM for megatron-core "
                     "models): the attention kernel is --attention-backend")
    lines += _checkpoint_differences(args) + _no_effect_lines(args) + own_way_lines(args)
    if args.num_workers != NUM_WORKERS_DEFAULT:
        lines.append(f"--num-workers {args.num_workers} has no effect: each rank reads its "
                     "microbatches by id in the training process, there is no data-loader pool")
    return lines + [f"{given} is Megatron-LM's default: accepted, it changes nothing (any other "
                    "value is refused)" for given in defaults_given(args)]


def _checkpoint_differences(args: argparse.Namespace) -> list[str]:
    lines = []
    if args.dist_ckpt_optim_fully_reshardable and not args.use_distributed_optimizer:
        lines.append("--dist-ckpt-optim-fully-reshardable has no effect without "
                     "--use-distributed-optimizer (as in Megatron-LM)")
    if args.distrib_optim_fully_reshardable_mem_efficient:
        lines.append("--distrib-optim-fully-reshardable-mem-efficient has no effect: it changes "
                     "how Megatron-LM gathers the state, not what is written, and the writing "
                     "replica already holds it")
    if args.ckpt_assume_constant_structure and args.ckpt_format != "torch_dist":
        lines.append("--ckpt-assume-constant-structure has no effect with --ckpt-format torch "
                     "(nothing is planned)")
    if args.auto_detect_ckpt_format:
        lines.append("--auto-detect-ckpt-format changes nothing: --load always detects the "
                     "checkpoint's format")
    if args.ckpt_fully_parallel_load:
        lines.append("--ckpt-fully-parallel-load has no effect: every rank already reads only "
                     "the slices its own layout needs")
    if args.async_save and args.async_strategy is not None:
        lines.append(f"--async-save writes on ReCoVer's own background writer (--async-strategy "
                     f"{args.async_strategy} names Megatron-LM's writers: no effect)")
    return lines + _non_persistent_differences(args)


def _no_effect_lines(args: argparse.Namespace) -> list[str]:
    # accepted because ReCoVer already gives their result
    given = (
        (args.ddp_average_in_collective, "--ddp-average-in-collective", "gradients are summed "
         "over replicas and divided by the global batch's token count (the same average)"),
        (args.overlap_param_gather_with_optimizer_step,
         "--overlap-param-gather-with-optimizer-step", "the weights' all-gathers already overlap "
         "the next forward with --overlap-param-gather"),
        (args.defer_embedding_wgrad_compute, "--defer-embedding-wgrad-compute", "it schedules "
         "transformer-engine's fused weight-gradient GEMMs; the embedding's gradient is the same"),
        (args.wgrad_deferral_limit != 0, f"--wgrad-deferral-limit {args.wgrad_deferral_limit}",
         "it limits --defer-embedding-wgrad-compute's schedule; the gradient is the same"))
    lines = [f"{flag} changes nothing: {why}" for on, flag, why in given if on]
    kept = [m for m in args.recompute_modules or () if m in KEPT_IN_MEMORY]
    if kept:
        lines.append(f"--recompute-modules {' '.join(kept)}: kept in memory, not recomputed "
                     "(megatron-core recomputes them only in transformer-engine's and the grouped "
                     "GEMM's modules); the same results, more activation memory")
    lines += [f"{flag} changes no result: {why}" for on, flag, why in _moe_kernels(args) if on]
    if args.check_for_spiky_loss and args.rerun_mode != "validate_results":
        lines.append("--check-for-spiky-loss has no effect without --rerun-mode validate_results "
                     "(as in Megatron-LM)")
    if args.check_for_large_grads and args.rerun_mode != "validate_results":
        lines.append("--check-for-large-grads has no effect without --rerun-mode "
                     "validate_results (as in Megatron-LM)")
    if args.calc_ft_timeouts and not args.enable_ft_package:
        lines.append("--calc-ft-timeouts has no effect without --enable-ft-package (as in "
                     "Megatron-LM)")
    return lines


def _moe_kernels(args: argparse.Namespace) -> tuple[tuple[bool, str, str], ...]:
    """transformer-engine's MoE kernels (Megatron-LM asks for a GPU of compute capability 8
    for the grouped GEMM): megatron-core's unfused modules compute the same thing, slower."""
    return (
        (args.moe_grouped_gemm, "--moe-grouped-gemm", "the experts' products are computed one "
         "GEMM per expert (megatron-core's SequentialMLP), not by a grouped kernel; weights are "
         "stored as SequentialMLP's, which megatron-core's grouped modules load (their optimizer "
         "state is laid out otherwise)"),
        (args.moe_permute_fusion, "--moe-permute-fusion", "megatron-core's unfused token "
         "permutation moves the same tokens"),
        (args.moe_router_fusion, "--moe-router-fusion", "megatron-core's unfused router computes "
         "the same top-k, probabilities and aux losses"),
        (args.moe_shared_expert_overlap, "--moe-shared-expert-overlap", "the shared experts run "
         "in turn instead of beside the token dispatch (megatron-core overlaps them on a CUDA "
         "stream); the same outputs"))


def _non_persistent_differences(args: argparse.Namespace) -> list[str]:
    lines = []
    if args.replication:  # checked by the argument checks: the copies are the same position
        lines.append(f"--replication: the --replication-factor {args.replication_factor} copies "
                     f"--replication-jump {args.replication_jump} ranks apart are those ranks' "
                     "own local checkpoints (the same (tp, pp) in other replicas): nothing is "
                     "sent")
    elif args.replication_jump is not None:
        lines.append("--replication-jump has no effect without --replication (Megatron-LM "
                     "ignores it too)")
    if args.non_persistent_local_ckpt_algo != "fully_parallel":
        lines.append(f"--non-persistent-local-ckpt-algo {args.non_persistent_local_ckpt_algo} "
                     "changes nothing: each rank writes its own file and sends nothing")
    return lines


def own_way_lines(args: argparse.Namespace) -> list[str]:
    """The start-up line of each flag of `arguments.flags.own_way` given: what ReCoVer does
    instead."""
    lines = []
    if not args.check_for_nan_in_loss_and_grad and args.rerun_mode != "disabled":
        lines.append("--no-check-for-nan-in-loss-and-grad: ReCoVer keeps its check of non-finite "
                     f"losses (--rerun-mode {args.rerun_mode}; --rerun-mode disabled turns it off)")
    elif not args.check_for_nan_in_loss_and_grad:
        lines.append("--no-check-for-nan-in-loss-and-grad changes nothing: --rerun-mode disabled "
                     "already turns the check of non-finite losses off")
    if not args.use_gloo_process_groups:
        lines.append("--disable-gloo-process-groups changes nothing: ReCoVer builds none of "
                     "Megatron-LM's gloo groups")
    if args.async_ckpt_use_cpu_shm:
        lines.append("--async-ckpt-use-cpu-shm changes nothing: --async-save's writer is a thread "
                     "of the training process, no shared memory is needed to reach the host copy")
    if args.test_mode:
        every = args.check_weight_hash_across_dp_replicas_interval or 1
        lines.append("--test-mode: the weights are compared over the DP replicas after every "
                     + ("iteration" if every == 1 else f"{every} iterations")
                     + " (Megatron-LM compares the q/k norm weights over DP and TP in every "
                     "attention forward; ReCoVer does not compare TP copies)")
    for flag, given in (("--export-force-local-attention", args.export_force_local_attention),
                        ("--enable-gpt-oss", args.enable_gpt_oss)):
        if given:
            lines.append(f"{flag} changes nothing: it shapes NVIDIA ModelOpt's model builder, "
                         "which Megatron-LM uses only to load a ModelOpt checkpoint or to "
                         "distil from a teacher")
    if layers_of(args) != args.transformer_impl:
        lines.append("--transformer-impl transformer_engine: the model is built from "
                     "megatron-core's local layers, on which ReCoVer builds "
                     + ("multi-latent attention" if args.multi_latent_attention
                        else "gated delta nets") + " (transformer-engine's kernels are not used)")
    if args.grad_reduce_in_bf16:
        lines.append("--grad-reduce-in-bf16: gradients are reduced in fp32 (ReCoVer's exact "
                     "reduction): 4 bytes per parameter on the wire instead of 2")
    if args.fsdp_double_buffer:
        lines.append("--fsdp-double-buffer changes nothing: each Megatron-FSDP gather allocates "
                     "what it needs")
    return lines + fsdp_lines(args) if args.use_megatron_fsdp else lines


def fsdp_lines(args: argparse.Namespace) -> list[str]:
    """Where Megatron-FSDP's flags run differently here (`arguments.validate.fsdp`)."""
    lines = ["--use-megatron-fsdp: runs the distributed optimizer (as Megatron-LM's version 1 "
             "does)"]
    if args.use_torch_fsdp2:
        lines = [f"--use-torch-fsdp2: runs as --use-megatron-fsdp's sharded parameters (not "
                 f"torch's fully_shard), in {args.num_distributed_optimizer_instances} shard "
                 "group(s) (--num-distributed-optimizer-instances); one group cannot lose a "
                 "member, K >= 2 groups survive one's loss"]
    if args.ckpt_format == "fsdp_dtensor":
        lines.append("--ckpt-format fsdp_dtensor: checkpoints are written as torch_dist (each "
                     "rank's parameters whole, the optimizer state as the distributed optimizer "
                     "writes it); they load at any layout, with or without Megatron-FSDP")
    strategy = args.data_parallel_sharding_strategy
    if shards_parameters(args):
        lines.append("--data-parallel-sharding-strategy optim_grads_params: parameters and "
                     "optimizer state are sharded over each shard group; gradients are "
                     "accumulated whole (4 bytes per parameter) and reduce-scattered once per "
                     "iteration, since a recovery re-runs lost microbatches on top of them")
    else:
        lines.append(f"--data-parallel-sharding-strategy {strategy}: runs as ReCoVer's "
                     "distributed optimizer (optimizer state sharded over each instance, "
                     "parameters and gradients whole), which survives any one replica's loss")
    if args.megatron_fsdp_grad_comm_dtype == "bf16":
        lines.append("--megatron-fsdp-grad-comm-dtype bf16: gradients are reduced in fp32: 4 "
                     "bytes per parameter on the wire instead of 2")
    if args.overlap_param_gather and shards_parameters(args):
        lines.append("--overlap-param-gather: each module's parameters are gathered when it "
                     "starts, not ahead of it")
    return lines


def shards_parameters(args: argparse.Namespace) -> bool:
    """Megatron-FSDP's optim_grads_params (ZeRO-3): each replica's parameters live sharded over
    its shard group."""
    return bool(args.use_megatron_fsdp) and args.data_parallel_sharding_strategy == \
        "optim_grads_params"


def asked_topology(args: argparse.Namespace, world_size: int) -> Topology:
    """The layout in the rank order the Megatron flags name (its default, or
    --use-tp-pp-dp-mapping's)."""
    return Topology.from_world(world_size, args.tensor_model_parallel_size,
                               args.pipeline_model_parallel_size, bool(args.use_tp_pp_dp_mapping),
                               cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
                               shard_groups=args.num_distributed_optimizer_instances
                               if shards_parameters(args) else None)


def node_size_of(environ: Mapping[str, str], world_size: int) -> int:
    """Ranks per node as the launcher (ours, torchrun, SLURM's per-node launch) numbers them:
    LOCAL_WORLD_SIZE, where it divides the world; else one node of every rank."""
    size = int(environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return size if 0 < size <= world_size and world_size % size == 0 else world_size


def placed_topology(args: argparse.Namespace, world_size: int, node_size: int) -> Topology:
    """The layout in the rank order the run uses: --recover-placement's choice for nodes of
    `node_size` ranks (`recover_patches/placement.py`)."""
    return placed(asked_topology(args, world_size), Nodes(node_size, world_size),
                  args.recover_placement)


def layers_of(args: argparse.Namespace) -> str:
    """The layer spec a run builds (--transformer-impl): multi-latent attention and gated delta
    nets are built from megatron-core's local layers, whatever it says (`own_way_lines` says so),
    since ReCoVer's TP split of their latents and heads is made and checked on those."""
    if args.transformer_impl == "transformer_engine" and (
            args.multi_latent_attention or args.experimental_attention_variant is not None):
        return "local"
    return args.transformer_impl
