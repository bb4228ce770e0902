"""The flags of `recover-preprocess` (Megatron-LM's tools/preprocess_data.py) and their checks:
one line and exit code 2 for a bad one."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron.training.arguments import OneLineParser
from megatron.training.errors import ArgumentError
from megatron.training.arguments.flags import add_tiktoken_args
from megatron.training.data.tokenizer import SUPPORTED_TYPES

# Named as the user called it: the `recover-preprocess` entry point or the script.
PROG = ("recover-preprocess" if os.path.basename(sys.argv[0]) == "recover-preprocess"
        else "preprocess_data.py")
DESCRIPTION = ("Tokenize text or JSONL into megatron-core indexed datasets (.bin/.idx), with the "
               "flags of Megatron-LM's tools/preprocess_data.py.")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, allow_abbrev=False, description=DESCRIPTION)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="input file or glob (.json/.jsonl or text)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to extract")
    group.add_argument("--split-sentences", action="store_true",
                       help="refused: needs nltk's punkt model, which is not downloaded offline")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines: always so here, as no sentence splitter removes them")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=SUPPORTED_TYPES)
    add_tiktoken_args(group)
    group.add_argument("--tokenizer-model", default=None,
                       help="HuggingFaceTokenizer: a directory holding tokenizer.json")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    group.add_argument("--append-eod", action="store_true", help="end every document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes in all")
    group.add_argument("--partitions", type=int, default=1,
                       help="contiguous parts of the input tokenized at once, joined at the end")
    group.add_argument("--log-interval", type=int, default=100,
                       help="documents between progress updates")
    args = parser.parse_args(argv)
    if args.split_sentences:
        raise ArgumentError("--split-sentences", "sentence splitting needs nltk's punkt model, "
                            "which cannot be downloaded here", "split sentences beforehand or drop it")
    for flag, value in (("--workers", args.workers), ("--partitions", args.partitions),
                        ("--log-interval", args.log_interval)):
        if value < 1:
            raise ArgumentError(flag, f"{flag} must be >= 1, got {value}", f"pass {flag} 1 or more")
    if args.workers % args.partitions:  # as Megatron: each partition gets the same worker count
        raise ArgumentError("--workers", f"--workers {args.workers} is not a multiple of "
                            f"--partitions {args.partitions}", "pass --workers k * partitions")
    return args
