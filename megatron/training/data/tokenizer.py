"""Tokenizers for GPT pre-training: GPT-2 byte-level BPE from local files, and Megatron's NullTokenizer.

Deliberately free of torch/megatron.core imports so that preprocessing workers start fast.

The objects here satisfy what megatron-core's `GPTDataset` / `MockGPTDataset` read from a tokenizer:
`.vocab_size`, `.eod` and `.unique_identifiers` (hashed into the dataset description). They define no
`.pad`, so megatron-core falls back to its own pad id (-1), which never collides with a real token.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Sequence

from megatron.training.errors import UserError
from megatron.training.config.io import TokenizerConfig

EOD_TOKEN = "<|endoftext|>"
SUPPORTED_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "TikTokenizer")
# Where a tokenizer.json directory names its end-of-sequence token (transformers writes it there).
HF_CONFIG = "tokenizer_config.json"
# pretrain_gpt.py's default when --tokenizer-type is not given.
DEFAULT_TYPE = "GPT2BPETokenizer"


class TokenizerError(UserError):
    """A user error in the tokenizer flags."""


class Tokenizer(ABC):
    """What the trainer, the datasets and the preprocessing script use from a tokenizer."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, before padding for the embedding table."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended by --append-eod and used for --eod-mask-loss."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": type(self).__name__, "vocab_size": self.vocab_size})

    # Fill-in-the-middle (data/fim.py) needs tokens by name and a sample's text: the text
    # tokenizers give them (arguments.validate refuses --fim-data with the others).
    @property
    def unknown_id(self) -> int | None:
        """The id Megatron-LM's tokenizer gives a token outside the vocabulary, if any."""
        return None

    def token_id(self, token: str) -> int | None:
        raise NotImplementedError(f"{type(self).__name__} does not look tokens up by name")

    def text_without_specials(self, ids: Sequence[int]) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not give text back")


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE read from a local vocab.json + merges.txt; never touches the network.

    Like Megatron's GPT-2 tokenizer, "<|endoftext|>" inside the text is not treated as special: it is
    tokenized as ordinary characters. Only --append-eod inserts the eod id.
    """

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = _read_vocab(vocab_file)
        if EOD_TOKEN not in vocab:
            raise TokenizerError(
                "--vocab-file",
                f"{vocab_file} has no {EOD_TOKEN!r} entry",
                "use a GPT-2 style vocab.json that contains the end-of-document token",
            )
        _check_merges(merge_file)
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # tokenizers raises plain Exception on bad merges
            raise TokenizerError(
                "--merge-file",
                f"cannot load BPE from {vocab_file} + {merge_file}: {error}",
                "pass the merges.txt that belongs to this vocab.json",
            ) from error
        self._hf = HFTokenizer(model)
        self._hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._hf.decoder = decoders.ByteLevel()
        self._vocab = vocab
        self._eod = vocab[EOD_TOKEN]
        self._files = (os.path.abspath(vocab_file), os.path.abspath(merge_file))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: token for token, i in self._vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    @property
    def unknown_id(self) -> int:
        return self._eod  # transformers' GPT-2 tokenizer: its unknown token is <|endoftext|>

    def token_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def text_without_specials(self, ids: Sequence[int]) -> str:
        return self._hf.decode([i for i in ids if i != self._eod], skip_special_tokens=False)

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["vocab_file"], ids["merge_file"] = self._files
        return ids


class HuggingFaceTokenizer(Tokenizer):
    """A local `tokenizer.json` (a directory holding one, or the file) through the `tokenizers`
    library, offline; Megatron's HuggingFaceTokenizer loads the same files through transformers.

    As there: tokenize() adds the tokenizer's own special tokens (its post-processor, e.g. a BOS),
    the vocabulary counts added tokens, and eod is the end-of-sequence token, read from
    `tokenizer_config.json`'s "eos_token" next to the file.
    """

    def __init__(self, model: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise TokenizerError("--tokenizer-model", f"no tokenizer.json at {path}",
                                 "pass a directory holding tokenizer.json (or the file itself)")
        try:
            self._hf = HFTokenizer.from_file(path)
        except Exception as error:  # tokenizers raises plain Exception on a bad file
            raise TokenizerError("--tokenizer-model", f"cannot load {path}: {error}",
                                 "pass a tokenizer.json written by the tokenizers library") from error
        eos = _eos_token(os.path.join(os.path.dirname(path), HF_CONFIG))
        eod = self._hf.token_to_id(eos) if eos is not None else None
        if eod is None:
            raise TokenizerError(
                "--tokenizer-model",
                f"no end-of-sequence token: {HF_CONFIG} next to {path} names none in the vocabulary",
                f'write {{"eos_token": "<token>"}} into {HF_CONFIG} beside tokenizer.json')
        self._eod, self._path = eod, os.path.abspath(path)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._hf.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._hf.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def text_without_specials(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=True)

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["tokenizer_model"] = self._path
        return ids


def _eos_token(config_path: str) -> str | None:
    """transformers' tokenizer_config.json names eos_token as a string or {"content": ...}."""
    try:
        with open(config_path, encoding="utf-8") as stream:
            eos = json.load(stream).get("eos_token")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise TokenizerError("--tokenizer-model", f"cannot read {config_path}: {error}",
                             f"fix or remove {config_path}") from error
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: text is space-separated ids, ids 0..V-1 are tokens and V is eod.

    So with --vocab-size V the vocabulary holds V + 1 ids.
    """

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        return [int(piece) for piece in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class TikTokenizer(Tokenizer):
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
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eod(self) -> int:
        return self.inner.eod

    def tokenize(self, text: str) -> list[int]:
        return self.inner.text_to_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.inner.ids_to_text(list(ids))

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": type(self).__name__, "tokenizer_model": self.path,
                            "pattern": self.pattern, "vocab_size": self.vocab_size})


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


def _read_vocab(vocab_file: str) -> dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as stream:
            vocab = json.load(stream)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(
            "--vocab-file", f"cannot read {vocab_file} as JSON: {error}", "pass a GPT-2 vocab.json"
        ) from error
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(
            "--vocab-file",
            f"{vocab_file} is not a token -> id mapping",
            "pass a GPT-2 style vocab.json ({\"token\": id, ...})",
        )
    return vocab


def _check_merges(merge_file: str) -> None:
    """Catch the common mix-up (vocab.json given as --merge-file) with a clear message."""
    try:
        with open(merge_file, encoding="utf-8") as stream:
            first = stream.readline()
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerError(
            "--merge-file", f"cannot read {merge_file}: {error}", "pass a GPT-2 merges.txt"
        ) from error
    if first.lstrip().startswith("{"):
        raise TokenizerError(
            "--merge-file",
            f"{merge_file} looks like a JSON vocabulary, not a merges list",
            "pass merges.txt to --merge-file and vocab.json to --vocab-file",
        )
