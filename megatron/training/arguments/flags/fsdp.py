"""Megatron-LM `pretrain_gpt.py` flags of Megatron-FSDP (version 1), with Megatron-LM's names and
defaults. `--data-parallel-sharding-strategy optim_grads_params` (ZeRO-3, the default) shards each
replica's parameters over its shard group, which fails and grows back as one unit (docs/design.md
§19); the other strategies run as ReCoVer's distributed optimizer. `validate.fsdp` checks them
and says at start-up where ReCoVer differs."""
from __future__ import annotations

import argparse

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def add_fsdp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron-fsdp")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP: with optim_grads_params each replica's parameters are "
                        "sharded over its shard group (DP / --num-distributed-optimizer-instances "
                        "replicas), gathered module by module for each forward and backward and "
                        "freed after. A shard group fails as one: the other groups finish its "
                        "microbatches. Turns on --use-distributed-optimizer, as Megatron-LM does.")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=SHARDING_STRATEGIES,
                   help="What Megatron-FSDP shards over a shard group: optim_grads_params "
                        "(parameters too; gradients are accumulated whole and reduce-scattered "
                        "once per iteration); optim, optim_grads and no_shard run as "
                        "--use-distributed-optimizer (a start-up line says so).")
    g.add_argument("--megatron-fsdp-version", type=int, default=1, choices=[1, 2],
                   help="Megatron-FSDP's version: 1 (version 2 is not supported yet).")
    g.add_argument("--megatron-fsdp-main-params-dtype", default="fp32",
                   choices=["fp32", "auto"],
                   help="The sharded main parameters' dtype: fp32 (auto: fp32 here too).")
    g.add_argument("--megatron-fsdp-main-grads-dtype", default="auto", choices=["auto", "fp32"],
                   help="The accumulated gradients' dtype: fp32 (auto is fp32 here).")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", default="auto",
                   choices=["auto", "fp32", "bf16"],
                   help="The gradient reduction's dtype: fp32 (bf16 is taken with a start-up "
                        "line: ReCoVer reduces in fp32).")
    g.add_argument("--outer-dp-sharding-strategy", default="no_shard", choices=["no_shard"],
                   help="What is sharded across shard groups: nothing (no_shard); each group "
                        "holds a whole copy, which is what lets one survive another's loss.")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="torch's FSDP2 in Megatron-LM: parameters, gradients and optimizer state "
                        "sharded over the data-parallel replicas. Runs as --use-megatron-fsdp's "
                        "sharded parameters (not torch's fully_shard), in one shard group unless "
                        "--num-distributed-optimizer-instances K says K: one group cannot lose "
                        "a member.")
    g.add_argument("--fsdp-double-buffer", action="store_true",
                   help="Megatron-FSDP: preallocated double buffers for the gathers (a GPU "
                        "memory-pool choice). No effect here (a start-up line says so).")
