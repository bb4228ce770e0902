"""Megatron-FSDP's flags against the rest (docs/design.md §19). Megatron-LM's own rules first:
version 1 turns the distributed optimizer on, and asks for `--ckpt-format fsdp_dtensor`, written
here as torch_dist (`config.io`). Then what ReCoVer does not build yet with a sharded model, one
line each."""
from __future__ import annotations

import argparse

from megatron.training.config.rules import shards_parameters
from megatron.training.errors import ArgumentError

_FLAG = "--use-megatron-fsdp"


def validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """Resolve Megatron-FSDP's flags (raise ArgumentError); `config.rules.fsdp_lines` says at
    start-up what ReCoVer does differently."""
    if not args.use_megatron_fsdp:
        if args.ckpt_format == "fsdp_dtensor":
            raise ArgumentError("--ckpt-format", "--ckpt-format fsdp_dtensor is Megatron-FSDP's "
                                "format (as in Megatron-LM)", "add --use-megatron-fsdp or pass "
                                "--ckpt-format torch_dist")
        return
    if args.megatron_fsdp_version != 1:
        raise ArgumentError("--megatron-fsdp-version", "--megatron-fsdp-version 2 is not "
                            "supported yet (version 1 is)", "drop the flag")
    _refuse_unbuilt(args)
    args.use_distributed_optimizer = True  # version 1 runs it, as in Megatron-LM


def _refuse_unbuilt(args: argparse.Namespace) -> None:
    """What a sharded model does not run with yet: one line each, naming the flag."""
    if not shards_parameters(args):
        return
    unbuilt = (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size > 1),
               ("--context-parallel-size", args.context_parallel_size > 1),
               ("--num-experts", args.num_experts is not None),
               ("--check-weight-hash-across-dp-replicas-interval",
                args.check_weight_hash_across_dp_replicas_interval is not None),
               ("--test-mode", args.test_mode))
    for flag, given in unbuilt:
        if given:
            why = ("compares the weights over the replicas, which a shard group holds only in "
                   "shards (Megatron-LM refuses it with optim_grads_params too)"
                   if flag in ("--check-weight-hash-across-dp-replicas-interval", "--test-mode")
                   else "with sharded parameters is not supported yet")
            raise ArgumentError(flag, f"{flag} {why} ({_FLAG} --data-parallel-sharding-strategy "
                                "optim_grads_params)", "drop the flag, or shard only the "
                                "optimizer: --data-parallel-sharding-strategy optim")

