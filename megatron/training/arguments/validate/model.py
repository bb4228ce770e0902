"""Checks and derived values for model shape, parallel layout and the device-dependent flags."""

from __future__ import annotations

import argparse
import importlib.util

from megatron.training.errors import ArgumentError
from megatron.training.arguments.validate.linear_attention import validate_linear_attention
from megatron.training.arguments.validate.pipeline import validate_pipeline_split
from megatron.training.config.rules import (KEPT_IN_MEMORY, RECOMPUTABLE,
                                            position_embedding_type_of, recompute_granularity_of)

DEVICES = ("cpu", "cuda")


def _require_positive(args: argparse.Namespace, dest: str, fix: str) -> None:
    flag = "--" + dest.replace("_", "-")
    value = getattr(args, dest)
    if value is None:
        raise ArgumentError(flag, f"{flag} is required", fix)
    if value < 1:
        raise ArgumentError(flag, f"{flag} must be >= 1, got {value}", fix)


def validate_parallel(args: argparse.Namespace, world_size: int) -> int:
    """The layout's checks; returns the data-parallel size (replicas)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require_positive(args, "tensor_model_parallel_size", "pass a positive --tensor-model-parallel-size")
    _require_positive(args, "pipeline_model_parallel_size",
                      "pass a positive --pipeline-model-parallel-size")
    cp = args.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        cp_part = f" * --context-parallel-size {cp}" if cp > 1 else ""
        raise ArgumentError(
            "--tensor-model-parallel-size",
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} * "
            f"--pipeline-model-parallel-size {pp}{cp_part} = {tp * pp * cp} (one model replica)",
            f"launch a multiple of {tp * pp * cp} ranks or change the TP/PP/CP sizes")
    dp = world_size // (tp * pp * cp)
    validate_distributed_optimizer(args, dp)
    return dp


def validate_distributed_optimizer(args: argparse.Namespace, dp: int) -> None:
    k = args.num_distributed_optimizer_instances
    flag = "--num-distributed-optimizer-instances"
    if k < 1:
        raise ArgumentError(flag, f"{flag} must be >= 1, got {k}", f"pass {flag} 1 or more")
    if k > 1 and not args.use_distributed_optimizer:
        raise ArgumentError(flag, f"{flag} {k} shards nothing without --use-distributed-optimizer",
                            "add --use-distributed-optimizer or drop the flag")
    if dp % k:
        raise ArgumentError(flag, f"{flag} {k} does not divide the data-parallel size {dp}",
                            f"pass a divisor of {dp}")
    gather = "--overlap-param-gather"
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError(gather, f"{gather} overlaps the distributed optimizer's weight "
                            "all-gather, and there is none", "add --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError(gather, f"{gather} needs --overlap-grad-reduce (as in Megatron-LM)",
                            "add --overlap-grad-reduce")


def validate_model_shape(args: argparse.Namespace) -> None:
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings"):
        flag = "--" + dest.replace("_", "-")
        _require_positive(args, dest, f"pass {flag} N (N >= 1)")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp != 0:
        raise ArgumentError(
            "--num-attention-heads",
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}", "use a head count that is a multiple of the TP size")
    validate_pipeline_split(args)
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(
            "--max-position-embeddings",
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}", f"set --max-position-embeddings >= {args.seq_length}")
    _derive_kv_channels(args)
    _derive_ffn_hidden_size(args)
    _validate_recompute(args)
    for flag, value in (("--hidden-dropout", args.hidden_dropout),
                        ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ArgumentError(flag, f"{flag} must be in [0, 1), got {value}", f"pass {flag} 0.1")
    if args.make_vocab_size_divisible_by < 1:
        raise ArgumentError("--make-vocab-size-divisible-by", "--make-vocab-size-divisible-by must be "
                            ">= 1", "pass --make-vocab-size-divisible-by 128")


def _validate_recompute(args: argparse.Namespace) -> None:
    """Megatron-LM's rules: --recompute-activations means selective; full needs a method; a method
    only goes with full."""
    granularity = recompute_granularity_of(args)
    if granularity == "full" and args.recompute_method is None:
        raise ArgumentError("--recompute-method", "--recompute-granularity full needs "
                            "--recompute-method", "pass --recompute-method uniform (or block)")
    if args.recompute_method is not None and granularity != "full":
        raise ArgumentError("--recompute-method", "--recompute-method goes with "
                            "--recompute-granularity full only",
                            "add --recompute-granularity full or drop --recompute-method")
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    unknown = set(args.recompute_modules or ()) - set(RECOMPUTABLE + KEPT_IN_MEMORY)
    if unknown:
        raise ArgumentError("--recompute-modules", f"--recompute-modules {' '.join(sorted(unknown))}"
                            ": not a module megatron-core recomputes for a GPT here (mla_up_proj"
                            " is multi-latent attention's under transformer-engine, not "
                            "supported yet)",
                            f"choose from {' '.join(RECOMPUTABLE + KEPT_IN_MEMORY)}")
    if args.recompute_method is not None and not 1 <= args.recompute_num_layers <= per_stage:
        raise ArgumentError("--recompute-num-layers", f"--recompute-num-layers "
                            f"{args.recompute_num_layers} must be in 1..{per_stage} (the layers "
                            "of one pipeline stage)", "pass --recompute-num-layers 1")


def _derive_kv_channels(args: argparse.Namespace) -> None:
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            raise ArgumentError(
                "--hidden-size", f"--hidden-size {args.hidden_size} is not divisible by "
                f"--num-attention-heads {args.num_attention_heads} and --kv-channels is not given",
                "make --hidden-size a multiple of --num-attention-heads, or pass --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    elif args.kv_channels < 1:
        raise ArgumentError("--kv-channels", f"--kv-channels must be >= 1, got {args.kv_channels}",
                            "drop --kv-channels (default hidden-size // num-attention-heads)")
    for flag in ("squared_relu", "quick_geglu"):
        if getattr(args, flag) and args.swiglu:  # Megatron-LM asserts the same
            option = "--" + flag.replace("_", "-")
            raise ArgumentError(option, f"{option} and --swiglu each choose the MLP's activation",
                                f"drop {option} or --swiglu")
    if args.rope_type == "yarn" and not args.multi_latent_attention:  # as Megatron-LM
        raise ArgumentError("--rope-type", "--rope-type yarn is for multi-latent attention",
                            "use --rope-type rope (or drop the flag), or add "
                            "--multi-latent-attention")
    _validate_mla(args)
    validate_linear_attention(args)
    _validate_window(args)
    # Rotary embeddings rotate channel pairs, so every head needs an even channel count.
    if position_embedding_type_of(args) == "rope" and args.kv_channels % 2 != 0:
        raise ArgumentError("--kv-channels", f"rope needs an even per-head size, got kv-channels "
                            f"{args.kv_channels}", "choose --hidden-size / --num-attention-heads "
                            "(or --kv-channels) giving an even per-head size")


def _derive_ffn_hidden_size(args: argparse.Namespace) -> None:
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Megatron-LM's rule: a gated MLP has two input projections, so shrink to 2/3 of 4*h
            # (keeping the parameter count) and round down to a multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
        if args.ffn_hidden_size < 1:
            raise ArgumentError("--ffn-hidden-size", f"--swiglu with --hidden-size {args.hidden_size} "
                                "gives an empty MLP (2/3*4*hidden rounds down to 0 in steps of 64)",
                                "pass --ffn-hidden-size explicitly")
    elif args.ffn_hidden_size < 1:
        raise ArgumentError("--ffn-hidden-size", f"--ffn-hidden-size must be >= 1, got "
                            f"{args.ffn_hidden_size}", "drop --ffn-hidden-size (default 4*hidden)")
    tp = args.tensor_model_parallel_size
    if args.ffn_hidden_size % tp != 0:
        raise ArgumentError("--ffn-hidden-size", f"--ffn-hidden-size {args.ffn_hidden_size} is not "
                            f"divisible by --tensor-model-parallel-size {tp}",
                            "use an MLP size that is a multiple of the TP size")


def validate_device_flags(args: argparse.Namespace, device: str) -> None:
    """Flags whose meaning depends on the device: CPU runs gloo and torch SDPA attention, without
    fused kernels (they are CUDA-only); a GPU runs NCCL and whatever megatron-core supports."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    on_cpu = device == "cpu"
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to split without TP
    if on_cpu and args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"  # documented meaning of the default on a CPU
    if on_cpu and args.attention_backend in ("flash", "fused"):
        raise ArgumentError("--attention-backend", f"--attention-backend {args.attention_backend} "
                            "needs a GPU", "use --attention-backend auto on CPU")
    if on_cpu:
        args.use_cpu_initialization = True  # there is no GPU to initialise on
        for dest in ("rope_fusion", "masked_softmax_fusion", "bias_gelu_fusion",
                     "bias_swiglu_fusion", "bias_dropout_fusion"):
            setattr(args, dest, False)
    _resolve_transformer_impl(args, on_cpu)
    _resolve_precision(args)
    _validate_attention(args)


def _validate_window(args: argparse.Namespace) -> None:
    """--window-size: ReCoVer's attention masks the band; its context-parallel exchange does not."""
    skip = args.window_attn_skip_freq
    if args.window_size is not None and args.context_parallel_size > 1:
        raise ArgumentError("--window-size", "--window-size with --context-parallel-size > 1 is "
                            "not supported yet", "drop one of them")
    if isinstance(skip, list) and len(skip) != args.num_layers:
        raise ArgumentError("--window-attn-skip-freq", f"--window-attn-skip-freq gives {len(skip)} "
                            f"layers, the model has --num-layers {args.num_layers}",
                            "give one 0/1 per layer")


def _validate_mla(args: argparse.Namespace) -> None:
    """--multi-latent-attention: megatron-core's MLASelfAttention in its local layers, split over
    TP by heads (its down projections by latent width, gathered before the norms); not yet over
    CP."""
    if not args.multi_latent_attention:
        return
    flag, whole = "--multi-latent-attention", "megatron-core's local MLA layers, without CP"
    tp = args.tensor_model_parallel_size
    for latent, width in (("--kv-lora-rank + --qk-pos-emb-head-dim",
                           args.kv_lora_rank + args.qk_pos_emb_head_dim),
                          ("--q-lora-rank", args.q_lora_rank or 0)):
        if width % tp:  # each TP rank projects its share of the latent's width
            raise ArgumentError(flag, f"{flag}: {latent} = {width} does not split over "
                                f"--tensor-model-parallel-size {tp}", f"give {latent} a multiple "
                                f"of {tp}")
    for given, other, why, fix in (
            (args.group_query_attention, "--group-query-attention",  # Megatron-LM asserts it
             "not possible: MLA shares its keys and values through a latent", "drop it"),
            (args.attention_output_gate, "--attention-output-gate",  # megatron-core raises
             "not supported by megatron-core's MLA yet", "drop it"),
            (args.qk_l2_norm, "--qk-l2-norm", "not supported by megatron-core's MLA yet",
             "drop it"),
            (args.context_parallel_size > 1, "--context-parallel-size > 1",
             f"not supported yet ({whole})", "use DP and PP")):
        if given:
            raise ArgumentError(flag, f"{flag} with {other} is {why}", f"{fix} ({other.split()[0]})")


def _resolve_transformer_impl(args: argparse.Namespace, on_cpu: bool) -> None:
    te_available = importlib.util.find_spec("transformer_engine") is not None
    if args.transformer_impl is None:  # with CP, ReCoVer's own attention (TE's is refused)
        te_default = not on_cpu and te_available and args.context_parallel_size == 1 \
            and not args.multi_latent_attention \
            and args.experimental_attention_variant is None  # megatron-core's local layers
        args.transformer_impl = "transformer_engine" if te_default else "local"
    elif args.transformer_impl == "transformer_engine":
        if on_cpu:
            raise ArgumentError("--transformer-impl", "transformer_engine needs a GPU",
                                "use --transformer-impl local on CPU (or drop the flag)")
        if not te_available:
            raise ArgumentError("--transformer-impl", "transformer_engine is not installed",
                                "pip install 'recover[gpu]' (transformer-engine) or use "
                                "--transformer-impl local")
    if not te_available:
        # megatron-core's fused rotary kernel is transformer-engine's; without it the default
        # (fusion on) would stop every run, so it resolves to the unfused kernel (same numbers).
        args.rope_fusion = False


def _resolve_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--bf16", "--fp16 and --bf16 are exclusive", "pass only one of them")
    if args.fp16:
        if args.loss_scale is not None and args.loss_scale <= 0:
            raise ArgumentError("--loss-scale", f"--loss-scale must be > 0, got {args.loss_scale}",
                                "drop --loss-scale (dynamic scaling) or pass a power of 2")
        if args.min_loss_scale <= 0:
            raise ArgumentError("--min-loss-scale", f"--min-loss-scale must be > 0, got "
                                f"{args.min_loss_scale} (the scale could reach 0 and zero every "
                                "gradient)", "pass --min-loss-scale 1")
        if args.initial_loss_scale < args.min_loss_scale:
            raise ArgumentError("--initial-loss-scale", f"--initial-loss-scale "
                                f"{args.initial_loss_scale} is below --min-loss-scale "
                                f"{args.min_loss_scale}", "pass --initial-loss-scale >= --min-loss-scale")
        if args.loss_scale_window < 1 or args.hysteresis < 1:
            raise ArgumentError("--loss-scale-window", "--loss-scale-window and --hysteresis must "
                                "be >= 1", "drop them (defaults 1000 and 2)")
    # Megatron-LM turns --accumulate-allreduce-grads-in-fp32 on for bf16; ReCoVer always
    # accumulates and reduces in fp32 (said at start-up for fp16: config_rules)


def _validate_attention(args: argparse.Namespace) -> None:
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups < 1 or heads % groups != 0:
            raise ArgumentError("--num-query-groups", f"--num-query-groups {groups} must divide "
                                f"--num-attention-heads {heads}", "pick a divisor of the head count")
        if groups % tp != 0:
            raise ArgumentError("--num-query-groups", f"--num-query-groups {groups} is not divisible "
                                f"by --tensor-model-parallel-size {tp}",
                                "use a group count that is a multiple of the TP size")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentError("--rotary-percent", f"--rotary-percent must be in (0, 1], got "
                            f"{args.rotary_percent}", "pass --rotary-percent 1.0")
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        raise ArgumentError("--reset-attention-mask", "--reset-attention-mask needs the dataset's "
                            "attention mask, which --no-create-attention-mask-in-dataloader turns off",
                            "drop one of the two flags")
