"""Tokenizers read through the `tokenizers` library (GPT-2 BPE, a HuggingFace tokenizer.json) and
Megatron's NullTokenizer."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Sequence

from megatron.training.data.tokenizer.base import EOD_TOKEN, HF_CONFIG, Tokenizer, TokenizerError

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
