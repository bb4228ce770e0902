"""--context-parallel-size and its flags: Megatron-LM's checks, and what ReCoVer does not
combine with context parallelism yet, each refused in one line naming the flag."""
from __future__ import annotations

import argparse
import math

from megatron.training.errors import ArgumentError

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")  # transformer-engine's
IMPLEMENTED = ("allgather", "p2p", "a2a")  # ReCoVer's own attention (context_parallel*.py)

# (set on the namespace, the flag): combinations not built or not tested with CP yet
_NOT_WITH_CP_YET = (
    (lambda a: a.reset_attention_mask, "--reset-attention-mask"),
    # the torch format's per-position files would work, but only torch_dist is tested with CP
    (lambda a: (a.save or a.load) and a.ckpt_format == "torch", "--ckpt-format"),
    (lambda a: a.non_persistent_ckpt_type is not None, "--non-persistent-ckpt-type"),
)


def validate_context_parallel(args: argparse.Namespace) -> None:
    cp, flag = args.context_parallel_size, "--context-parallel-size"
    if cp < 1:
        raise ArgumentError(flag, f"{flag} must be >= 1, got {cp}", f"pass a positive {flag}")
    _check_comm_type(args, cp)
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        raise ArgumentError(flag, f"--seq-length {args.seq_length} does not split into 2 x {flag} "
                            f"{cp} = {2 * cp} equal chunks (Megatron's load-balanced layout)",
                            f"pass a --seq-length that is a multiple of {2 * cp}")
    for given, other in _NOT_WITH_CP_YET:
        if given(args):
            raise ArgumentError(other, f"{other} with {flag} {cp} is not supported by ReCoVer "
                                "yet", f"drop {other}, or use {flag} 1")


def _check_comm_type(args: argparse.Namespace, cp: int) -> None:
    kinds, flag = args.cp_comm_type, "--cp-comm-type"
    unknown = [k for k in kinds if k not in CP_COMM_TYPES]
    if unknown:
        raise ArgumentError(flag, f"{flag} {unknown[0]}: not one of {', '.join(CP_COMM_TYPES)}",
                            f"pass {flag} allgather")
    if len(kinds) not in (1, args.num_layers):
        raise ArgumentError(flag, f"{flag} takes one value or one per layer ({args.num_layers}), "
                            f"got {len(kinds)}", f"pass one {flag} value")
    sizes = args.hierarchical_context_parallel_sizes
    if "a2a+p2p" in kinds and (sizes is None or math.prod(sizes) != cp):
        raise ArgumentError("--hierarchical-context-parallel-sizes", "--cp-comm-type a2a+p2p needs "
                            "--hierarchical-context-parallel-sizes whose product is "
                            f"--context-parallel-size {cp}", "pass the two levels' sizes")
    if cp == 1:
        return
    if any(k not in IMPLEMENTED for k in kinds):
        raise ArgumentError(flag, f"{flag} a2a+p2p (hierarchical) is not implemented by "
                            "ReCoVer's attention", f"pass {flag} p2p, a2a or allgather")
    if len(set(kinds)) > 1:
        raise ArgumentError(flag, f"{flag} with a value per layer: megatron-core 0.16.1 indexes "
                            "the list by the 1-based layer number and fails on the last layer",
                            f"pass one {flag} value")
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    groups = (args.num_query_groups if args.group_query_attention
              else args.num_attention_heads) // args.tensor_model_parallel_size
    if "a2a" in kinds and (heads % cp or groups % cp):
        raise ArgumentError(flag, f"{flag} a2a gives each CP rank 1/{cp} of a TP rank's heads: "
                            f"{heads} attention heads and {groups} query groups per TP rank do not "
                            f"divide by --context-parallel-size {cp}", f"pass {flag} p2p")

