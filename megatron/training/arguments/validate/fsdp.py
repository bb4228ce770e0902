"""Megatron-FSDP's flags against the rest (docs/design.md §19). Megatron-LM's own rules first:
version 1 turns the distributed optimizer on, and asks for `--ckpt-format fsdp_dtensor`, written
here as torch_dist (`config.io`). Then what does not run with a sharded model, one line each."""
from __future__ import annotations

import argparse

from megatron.training.config.rules import shards_parameters
from megatron.training.errors import ArgumentError

_FLAG = "--use-megatron-fsdp"


def validate_megatron_fsdp(args: argparse.Namespace) -> None:
    """Resolve Megatron-FSDP's flags (raise ArgumentError); `config.rules.fsdp_lines` says at
    start-up what ReCoVer does differently."""
    if args.use_torch_fsdp2:  # the same sharding of parameters, ReCoVer's one
        if args.use_megatron_fsdp:
            raise ArgumentError("--use-torch-fsdp2", "--use-torch-fsdp2 and --use-megatron-fsdp "
                                "are two ways to shard the parameters (as in Megatron-LM)",
                                "pass only one of them")
        args.use_megatron_fsdp, args.data_parallel_sharding_strategy = True, "optim_grads_params"
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
    """What a sharded model does not run with: one line each, naming the flag."""
    if not shards_parameters(args):
        return
    if args.expert_model_parallel_size > 1:
        raise ArgumentError("--expert-model-parallel-size", "--expert-model-parallel-size > 1 "
                            f"with {_FLAG} is not supported yet: a unit of replicas is either "
                            "expert-parallel or a shard group", "drop one of them, or shard "
                            "only the optimizer: --data-parallel-sharding-strategy optim")
    if args.rerun_mode == "report_stats":
        raise ArgumentError("--rerun-mode", f"--rerun-mode report_stats with {_FLAG} is not "
                            "supported yet: it re-runs one replica's microbatches, and a shard "
                            "group's replicas run together", "drop the flag (validate_results, "
                            "the default, is)")
    for flag, given in (("--check-weight-hash-across-dp-replicas-interval",
                         args.check_weight_hash_across_dp_replicas_interval is not None),
                        ("--test-mode", args.test_mode)):
        if given:
            raise ArgumentError(flag, f"{flag} compares the weights over the replicas, which a "
                                "shard group holds only in shards (Megatron-LM refuses it with "
                                "optim_grads_params too)", "drop the flag, or shard only the "
                                "optimizer: --data-parallel-sharding-strategy optim")
