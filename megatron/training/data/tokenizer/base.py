"""What every tokenizer gives the trainer, the datasets and preprocessing."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Sequence

from megatron.training.errors import UserError

EOD_TOKEN = "<|endoftext|>"

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
