"""Megatron-LM flags ReCoVer knows but refuses: removed upstream, or not supported by ReCoVer yet.

They are registered on the parser with an action that raises at once, so the user learns what to do
instead of getting argparse's generic "unrecognized arguments".
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from megatron.training.errors import ArgumentError


class RefusedFlag(NamedTuple):
    flag: str
    nargs: int  # values the flag takes, so argparse consumes them instead of reporting them unknown
    message: str
    fix: str


_NOT_YET = "is not supported by ReCoVer yet"

REMOVED_FLAGS: tuple[RefusedFlag, ...] = (
    RefusedFlag("--data-impl", 1, "was removed from Megatron-LM: indexed datasets are always mmap",
                "drop the flag"),
    RefusedFlag("--checkpoint-activations", 0,
                "was removed from Megatron-LM, replaced by --recompute-activations / "
                "--recompute-granularity", "use --recompute-activations (selective) or "
                "--recompute-granularity full --recompute-method uniform"),
    RefusedFlag("--activations-checkpoint-method", 1,
                "was removed from Megatron-LM, replaced by --recompute-method",
                "use --recompute-granularity full --recompute-method uniform|block"),
)

UNSUPPORTED_FLAGS: tuple[RefusedFlag, ...] = tuple(
    RefusedFlag(flag, nargs, _NOT_YET, "drop the flag")
    for flag, nargs in (
        ("--fp8-format", 1),
    )
)


class _RefuseAction(argparse.Action):
    def __init__(self, option_strings, dest, refused: RefusedFlag, **kwargs) -> None:
        self.refused = refused
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        r = self.refused
        raise ArgumentError(r.flag, f"{r.flag} {r.message}", r.fix)


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    for refused in REMOVED_FLAGS + UNSUPPORTED_FLAGS:
        parser.add_argument(refused.flag, nargs=refused.nargs, action=_RefuseAction,
                            refused=refused, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def reject_unsupported_values(args: argparse.Namespace) -> None:
    """Flags ReCoVer accepts but not with every value Megatron-LM allows."""
    if args.optimizer != "adam":
        raise ArgumentError("--optimizer", f"--optimizer {args.optimizer} {_NOT_YET}",
                            "use --optimizer adam")
    if args.async_save and args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise ArgumentError("--async-save", "--async-save needs --ckpt-format torch_dist",
                            "drop --ckpt-format torch (torch_dist is the default) or --async-save")
