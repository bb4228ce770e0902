"""Megatron-LM `pretrain_gpt.py` flags of fill-in-the-middle data (data/fim.py), with its names
and defaults."""
from __future__ import annotations

import argparse


def add_fim_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fill-in-the-middle data")
    g.add_argument("--fim-data", action="store_true",
                   help="Rewrite samples as fill-in-the-middle (Megatron-LM's FIM dataset). Each "
                        "sample draws from its own generator, seeded by --seed and its index, so "
                        "the data do not depend on the replicas alive.")
    g.add_argument("--fim-rate", type=float, default=0.5,
                   help="Probability that a segment between end-of-document tokens is rewritten.")
    g.add_argument("--fim-spm-rate", type=float, default=0.5,
                   help="Probability that a rewritten segment is suffix-prefix-middle rather than "
                        "prefix-suffix-middle.")
    g.add_argument("--fim-split-sample", type=str, default=None,
                   help="A token at which segments are split into fragments, each rewritten on "
                        "its own at --fim-fragment-rate (e.g. the file separator of a repository).")
    g.add_argument("--fim-fragment-rate", type=float, default=None,
                   help="Probability that a fragment is rewritten, with --fim-split-sample.")
    g.add_argument("--fim-no-prefix", type=str, default=None,
                   help="Leave alone a segment whose text starts with this string.")
    g.add_argument("--fim-prefix-token", type=str, default="<fim_prefix>",
                   help="The sentinel before the prefix.")
    g.add_argument("--fim-middle-token", type=str, default="<fim_middle>",
                   help="The sentinel before the middle.")
    g.add_argument("--fim-suffix-token", type=str, default="<fim_suffix>",
                   help="The sentinel before the suffix.")
    g.add_argument("--fim-pad-token", type=str, default="<fim_pad>",
                   help="The token that pads a rewritten sample that came out short.")
    g.add_argument("--fim-eod-token", type=str, default="<|endoftext|>",
                   help="The end-of-document token at which samples are cut into segments.")
