"""Tokenizers through megatron-core's wrappers of the tiktoken and sentencepiece libraries
(imported when built, so preprocessing workers start without megatron-core)."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

from megatron.training.config.io import TokenizerConfig
from megatron.training.data.tokenizer.base import Tokenizer, TokenizerError


class MegatronCoreTokenizer(Tokenizer):
    """A tokenizer that megatron-core's library wrapper (`inner`) answers for."""
    inner: Any

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eod(self) -> int:
        return self.inner.eod

    def tokenize(self, text: str) -> list[int]:
        return self.inner.text_to_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.inner.ids_to_text(list(ids))


class TikTokenizer(MegatronCoreTokenizer):
    """Megatron-LM's TikTokenizer: megatron-core's TikTokenTokenizer (the tiktoken library) over
    a JSON vocabulary (--tokenizer-model), split by --tiktoken-pattern, its first
    --tiktoken-num-special-tokens ids special (`</s>` is the end of a document)."""

    def __init__(self, path: str, config: TokenizerConfig):
        from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
        options: dict = {"num_special_tokens": config.tiktoken_special,
                         "special_tokens": None if config.special_tokens is None
                         else list(config.special_tokens)}
        if config.tiktoken_pattern:
            options["pattern"] = config.tiktoken_pattern
        if config.vocab_size:
            options["vocab_size"] = config.vocab_size
        self.path, self.pattern = path, config.tiktoken_pattern or "v2"
        try:
            self.inner = TikTokenTokenizer(path, **options)
        except (AssertionError, ValueError, KeyError) as err:  # megatron-core checks by assert
            raise TokenizerError("--tokenizer-model", f"cannot build a TikTokenizer from {path} "
                                 f"({type(err).__name__}: {str(err)[:160]})",
                                 "pass tiktoken's JSON vocabulary; --vocab-size must not exceed "
                                 "its entries plus --tiktoken-num-special-tokens") from None

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": type(self).__name__, "tokenizer_model": self.path,
                            "pattern": self.pattern, "vocab_size": self.vocab_size})


class SentencePieceModel(MegatronCoreTokenizer):
    """Megatron-LM's SentencePiece tokenizers (GPTSentencePieceTokenizer, SentencePieceTokenizer,
    Llama2Tokenizer): megatron-core's wrapper of the sentencepiece library over a .model file,
    with --tokenizer-sentencepiece-legacy and its extra-whitespace rule; eod is the model's
    end-of-sentence id, as megatron-core answers it."""

    def __init__(self, path: str, config: TokenizerConfig):
        from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
            SentencePieceTokenizer)
        self.path, self.kind = os.path.abspath(path), config.kind
        self.legacy, self.ignore_spaces = config.sp_legacy, config.sp_ignore_extra_whitespaces
        try:
            self.inner = SentencePieceTokenizer(
                path, special_tokens=None if config.special_tokens is None
                else list(config.special_tokens), legacy=self.legacy,
                ignore_extra_whitespaces=self.ignore_spaces)
        except (OSError, RuntimeError, ValueError) as err:  # sentencepiece: a bad model file
            raise TokenizerError("--tokenizer-model", f"cannot load a SentencePiece model from "
                                 f"{path} ({type(err).__name__}: {str(err)[:160]})",
                                 "pass the tokenizer's .model file") from None

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": self.kind, "tokenizer_model": self.path,
                            "legacy": self.legacy, "ignore_extra_whitespaces": self.ignore_spaces,
                            "vocab_size": self.vocab_size})
