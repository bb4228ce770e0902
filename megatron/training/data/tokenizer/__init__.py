"""Tokenizers for GPT pre-training, by --tokenizer-type: GPT-2 byte-level BPE from local files, a
HuggingFace tokenizer.json, Megatron's NullTokenizer (`text.py`), and TikToken and SentencePiece
through megatron-core's wrappers (`megatron_core.py`).

Free of torch/megatron.core imports until a megatron-core one is built, so that preprocessing
workers start fast.

The objects here satisfy what megatron-core's `GPTDataset` / `MockGPTDataset` read from a tokenizer:
`.vocab_size`, `.eod` and `.unique_identifiers` (hashed into the dataset description). They define no
`.pad`, so megatron-core falls back to its own pad id (-1), which never collides with a real token.
"""

from __future__ import annotations

import os

from megatron.training.config.io import SENTENCEPIECE_TYPES, SUPPORTED_TYPES, TokenizerConfig
from megatron.training.data.tokenizer.base import (DEFAULT_TYPE, EOD_TOKEN, HF_CONFIG, Tokenizer,
                                                   TokenizerError)
from megatron.training.data.tokenizer.megatron_core import SentencePieceModel, TikTokenizer
from megatron.training.data.tokenizer.text import (GPT2BPETokenizer, HuggingFaceTokenizer,
                                                   NullTokenizer)

__all__ = ["DEFAULT_TYPE", "EOD_TOKEN", "HF_CONFIG", "SUPPORTED_TYPES", "GPT2BPETokenizer",
           "HuggingFaceTokenizer", "NullTokenizer", "SentencePieceModel", "TikTokenizer",
           "Tokenizer", "TokenizerError", "build_tokenizer", "padded_vocab_size"]


def build_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer named by --tokenizer-type; raises TokenizerError on a user error."""
    kind = config.kind or DEFAULT_TYPE
    if kind == "GPT2BPETokenizer":
        vocab_file = _required_file(config.vocab_file, "--vocab-file", "vocab.json")
        merge_file = _required_file(config.merge_file, "--merge-file", "merges.txt")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "HuggingFaceTokenizer":
        if not config.model:
            raise TokenizerError("--tokenizer-model", "HuggingFaceTokenizer needs a tokenizer",
                                 "pass --tokenizer-model DIR (a directory holding tokenizer.json)")
        return HuggingFaceTokenizer(config.model)
    if kind == "NullTokenizer":
        vocab_size = config.vocab_size
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(
                "--vocab-size",
                "NullTokenizer needs a positive vocabulary size",
                "pass --vocab-size N (ids 0..N-1 are tokens, N is the end-of-document id)",
            )
        return NullTokenizer(int(vocab_size))
    if kind in SENTENCEPIECE_TYPES:
        if not config.model or not os.path.isfile(config.model):
            raise TokenizerError("--tokenizer-model", f"{kind} needs its SentencePiece model "
                                 f"({config.model or 'none given'})",
                                 "pass --tokenizer-model PATH/tokenizer.model")
        return SentencePieceModel(config.model, config)
    if kind == "TikTokenizer":
        if not config.model or not os.path.isfile(config.model):
            raise TokenizerError("--tokenizer-model", f"TikTokenizer needs its JSON vocabulary "
                                 f"({config.model or 'none given'})",
                                 "pass --tokenizer-model PATH/tokenizer.json")
        return TikTokenizer(config.model, config)
    raise TokenizerError(
        "--tokenizer-type",
        f"unsupported tokenizer {kind!r}",
        f"use one of {', '.join(SUPPORTED_TYPES)}",
    )


def padded_vocab_size(orig: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of divisible_by * TP size, so every
    tensor-parallel shard of the embedding gets an equal, aligned slice."""
    multiple = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(orig) // multiple) * multiple


def _required_file(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise TokenizerError(
            flag,
            f"GPT2BPETokenizer needs a {what}",
            f"pass {flag} PATH/{what} (scripts/prepare_demo_data.py writes a demo one)",
        )
    if not os.path.isfile(path):
        raise TokenizerError(flag, f"{path} does not exist", f"pass an existing {what} to {flag}")
    return path
