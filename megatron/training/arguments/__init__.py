"""Command line of `pretrain_gpt_recover.py`: Megatron-LM's `pretrain_gpt.py` flags plus ReCoVer's.

Attribute names are Megatron-LM's argparse dests (args.num_layers, args.micro_batch_size, ...), so
code written against Megatron's `args` reads ours the same way. The flags themselves are declared in
`arguments.flags` / `arguments.recover` / `arguments.refused`, the rules in `arguments.validate`.

Resolved by `validate_args` as Megatron-LM resolves them: the ffn/kv/lr-decay/global-batch
defaults and the CPU fallbacks. What Megatron-LM also writes into its args -- world_size, rank,
local_rank, data_parallel_size, device, params_dtype -- is `config.RunLayout` (and
`config.params_dtype_of`) here; checkpoints still store them in Megatron's `args`.
Deviations from Megatron-LM, each documented in the flag's help: --ckpt-format defaults to torch;
on CPU --distributed-backend nccl means gloo; --rampup-batch-size is allowed with --train-iters;
args.recover is a bool; args.attention_backend stays a string.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from typing import NoReturn

from megatron.training.errors import ArgumentError
from megatron.training.arguments.flags import (
    add_batch_args, add_data_args, add_logging_args, add_model_args, add_optimizer_args,
    add_parallel_args, add_precision_args)
from megatron.training.arguments.flags.checkpoint import add_checkpoint_args
from megatron.training.arguments.flags.fim import add_fim_args
from megatron.training.arguments.flags.fsdp import add_fsdp_args
from megatron.training.arguments.flags.linear_attention import add_linear_attention_args
from megatron.training.arguments.flags.mla import add_mla_args
from megatron.training.arguments.flags.numerics import add_numerics_args
from megatron.training.arguments.flags.own_way import add_own_way_args
from megatron.training.arguments.refused import add_megatron_refusals
from megatron.training.arguments.recover import (add_ft_package_args, add_recover_args,
                                                  apply_recover_env_defaults)
from megatron.training.arguments.refused.unsupported import add_refused_args, reject_unsupported_values
from megatron.training.arguments.validate.io import (
    validate_checkpointing, validate_data, validate_logging, validate_non_persistent, validate_recover,
    validate_tokenizer)
from megatron.training.arguments.flags.moe import add_moe_args
from megatron.training.arguments.validate.context import validate_context_parallel
from megatron.training.arguments.validate.fsdp import validate_megatron_fsdp
from megatron.training.arguments.validate.moe import validate_expert_layout, validate_moe
from megatron.training.arguments.validate.model import (
    validate_device_flags, validate_model_shape, validate_parallel)
from megatron.training.arguments.validate.pipeline import validate_pipeline_backend
from megatron.training.arguments.validate.schedule import (
    global_batch_size_at, validate_batch, validate_lr_and_weight_decay, validate_training_length)

__all__ = ["ArgumentError", "build_parser", "parse_args", "validate_args", "parse_and_validate",
           "global_batch_size_at", "PROG"]

PROG = "pretrain_gpt_recover.py"
logger = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a missing or malformed value) become one
    ArgumentError -- one stderr line naming the flag and the fix -- instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            accepted = [f for f, action in self._option_string_actions.items()
                        if action.default is not argparse.SUPPRESS]  # not a refused flag
            close = difflib.get_close_matches(flag, accepted, n=1)
            raise ArgumentError(flag, f"unknown flag {flag}",
                                f"did you mean {close[0]}?" if close else
                                f"drop it ({self.prog} --help lists every flag)")
        named = re.search(r"--[\w-]+", message)
        flag = named.group(0) if named else "arguments"
        raise ArgumentError(flag, re.sub(r"^argument [^:]+: ", "", message),
                            f"see {self.prog} --help for {flag}")

    def parse_known_args(self, args=None, namespace=None):
        # unknown flags first: argparse would otherwise report a missing required flag instead
        for token in sys.argv[1:] if args is None else args:
            flag = token.split("=")[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                self.error(f"unrecognized arguments: {token}")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False as in Megatron-LM: a prefix of a flag must not silently mean the flag.
    parser = OneLineParser(
        prog=PROG, allow_abbrev=False,
        description="Resilient GPT pre-training: Megatron-LM pretrain_gpt.py flags plus ReCoVer's.")
    for add_group in (add_model_args, add_parallel_args, add_batch_args, add_optimizer_args,
                      add_data_args, add_checkpoint_args, add_logging_args, add_precision_args,
                      add_numerics_args, add_recover_args, add_ft_package_args, add_moe_args,
                      add_mla_args, add_linear_attention_args, add_fim_args, add_fsdp_args,
                      add_own_way_args,
                      add_refused_args):
        add_group(parser)
    add_megatron_refusals(parser)  # last: every Megatron-LM flag not declared above
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse only. argparse's own errors exit 2; refused Megatron flags raise ArgumentError."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    apply_recover_env_defaults(args)
    reject_unsupported_values(args)
    return args


def validate_args(args: argparse.Namespace, world_size: int, device: str = "cpu") -> argparse.Namespace:
    """Check the flags against each other and the job, resolve Megatron's defaults (the run's
    layout is not written here: `config.RunLayout`); raise ArgumentError."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    reject_unsupported_values(args)  # also for namespaces that did not come from parse_args
    validate_context_parallel(args)
    validate_moe(args, device)
    validate_megatron_fsdp(args)  # (before the layout: it turns the distributed optimizer on)
    dp = validate_parallel(args, world_size)
    validate_expert_layout(args, dp)
    validate_model_shape(args)
    validate_device_flags(args, device)
    validate_pipeline_backend(args, device)
    validate_batch(args, dp)
    validate_training_length(args)
    validate_lr_and_weight_decay(args)
    warnings = validate_data(args)
    validate_tokenizer(args)
    validate_checkpointing(args)
    validate_non_persistent(args, world_size)
    validate_logging(args)
    validate_recover(args, dp)
    # Printed only once everything passed, so a failing run shows exactly one error line.
    if os.environ.get("RANK", "0") == "0":
        for line in warnings:
            logger.warning(line)
    return args


def parse_and_validate(argv: list[str] | None, world_size: int, device: str = "cpu") -> argparse.Namespace:
    """The entry point's call: a user error becomes one stderr line and exit code 2."""
    try:
        return validate_args(parse_args(argv), world_size, device)
    except ArgumentError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
