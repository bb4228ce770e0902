"""Checks of gated delta net layers (--experimental-attention-variant): megatron-core's config
rules, said in one line, and what ReCoVer does not build yet."""
from __future__ import annotations

import argparse

from megatron.training.arguments.flags.linear_attention import GATED_DELTA_NET
from megatron.training.errors import ArgumentError

FLAG = "--experimental-attention-variant"


def validate_linear_attention(args: argparse.Namespace) -> None:
    variant = args.experimental_attention_variant
    if variant is None:
        return
    if variant not in GATED_DELTA_NET:
        raise ArgumentError(FLAG, f"{FLAG} {variant} is not supported yet (megatron-core 0.16.1 "
                            "builds gated_delta_net; gdn2 and dsa need a newer one)",
                            "use --experimental-attention-variant gated_delta_net")
    _check_pattern(args)
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise ArgumentError("--linear-num-value-heads", f"--linear-num-value-heads "
                            f"{args.linear_num_value_heads} is not a multiple of "
                            f"--linear-num-key-heads {args.linear_num_key_heads}",
                            "give a multiple of the key heads")
    tp = args.tensor_model_parallel_size
    for flag, heads in (("--linear-num-key-heads", args.linear_num_key_heads),
                        ("--linear-num-value-heads", args.linear_num_value_heads)):
        if heads % tp:
            raise ArgumentError(flag, f"{flag} {heads} does not split over "
                                f"--tensor-model-parallel-size {tp}", f"give a multiple of {tp}")
    whole = "megatron-core's gated delta net has no context parallelism"
    for given, other, fix in (
            (args.context_parallel_size > 1, "--context-parallel-size > 1",
             "use DP and PP (megatron-core's gated delta net has no context parallelism)"),
            (args.multi_latent_attention, "--multi-latent-attention", "drop one of them")):
        if given:
            raise ArgumentError(FLAG, f"{FLAG} with {other} is not supported yet ({whole})",
                                f"{fix} ({other.split()[0]})")


def _check_pattern(args: argparse.Namespace) -> None:
    pattern = args.linear_attention_freq
    if pattern is None:
        raise ArgumentError("--linear-attention-freq", f"{FLAG} needs --linear-attention-freq "
                            "(which layers are gated delta nets)", "pass --linear-attention-freq 4 "
                            "(every 4th layer keeps softmax attention)")
    if isinstance(pattern, list) and len(pattern) != args.num_layers:
        raise ArgumentError("--linear-attention-freq", f"--linear-attention-freq gives "
                            f"{len(pattern)} layers, the model has --num-layers "
                            f"{args.num_layers}", "give one 0/1 per layer")
    if isinstance(pattern, int) and pattern < 1:
        raise ArgumentError("--linear-attention-freq", f"--linear-attention-freq {pattern} is "
                            "not a positive layer count", "pass e.g. --linear-attention-freq 4")
