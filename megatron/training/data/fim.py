"""Fill-in-the-middle samples (--fim-data): Megatron-LM's FIM transformation of GPT samples.

A sample's text is cut at two random character positions into prefix, middle and suffix and
rewritten, with sentinel tokens, as prefix-suffix-middle (PSM) or suffix-prefix-middle (SPM), so
the model learns to fill a gap. The rules are Megatron-LM's `GPTFIMDataset`: each segment between
end-of-document tokens is transformed on its own; with --fim-split-sample, a segment is first
split at that token and its fragments are transformed at --fim-fragment-rate; the sample keeps its
length (cut, or padded with the pad sentinel).

Where the random draws come from differs, on purpose. Megatron-LM draws from one generator per
dataset object, in the order that object is read, so a sample's draws depend on which samples its
reader read before it: on the data-parallel size, on --num-workers, and on where the run resumed.
ReCoVer's invariant needs the data of microbatch g to be a function of g, whichever replica runs
it after whatever failures. So each sample draws from its own generator, seeded by (--seed, the
sample's index in its dataset), consuming the draws in Megatron-LM's order. Given the same draws,
a sample is byte for byte Megatron-LM's (docs/verified.md says how that was checked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy

from megatron.training.config.io import FimFlags
from megatron.training.errors import UserError


class FimTokenizer(Protocol):
    """What the transformation needs from a tokenizer: Megatron-LM's tokens_to_ids, ids_to_text
    (special tokens removed) and text_to_ids."""

    def token_id(self, token: str) -> Optional[int]: ...

    def text_without_specials(self, ids: Sequence[int]) -> str: ...

    def tokenize(self, text: str) -> list[int]: ...


TOKEN_FLAGS = ("--fim-prefix-token", "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token",
               "--fim-eod-token")


@dataclass(frozen=True)
class FimTokenIds:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: Optional[int]  # --fim-split-sample's id


def resolve_token_ids(flags: FimFlags, tokenizer: FimTokenizer, unknown_id: Optional[int]
                      ) -> tuple[FimTokenIds, list[str]]:
    """The sentinels' ids, and a start-up line for each token the vocabulary lacks.

    A missing token becomes `unknown_id`, as Megatron-LM's tokenizers map it (GPT-2's unknown
    token is its end of text); a tokenizer without one cannot take the flag."""
    ids: list[int] = []
    notes: list[str] = []
    named = list(zip(TOKEN_FLAGS, flags.tokens))
    if flags.split_sample is not None:
        named.append(("--fim-split-sample", flags.split_sample))
    for flag, token in named:
        found = tokenizer.token_id(token)
        if found is None:
            if unknown_id is None:
                raise UserError(flag, f"{token!r} is not a token of this tokenizer's vocabulary",
                                f"give {flag} a token of the vocabulary")
            notes.append(f"{flag} {token!r} is not in the vocabulary: it is the unknown token "
                         f"(id {unknown_id}), as Megatron-LM's tokenizer maps it")
            found = unknown_id
        ids.append(found)
    prefix, middle, suffix, pad, eod = ids[:5]
    split = ids[5] if flags.split_sample is not None else None
    return FimTokenIds(prefix, middle, suffix, pad, eod, split), notes


def sample_generator(seed: int, index: int) -> numpy.random.RandomState:
    """Per-sample draws: the same for sample `index` whoever reads it, in whatever order."""
    return numpy.random.RandomState([seed & 0xFFFFFFFF, int(index) & 0xFFFFFFFF, int(index) >> 32])


class FillInTheMiddle:
    """Megatron-LM's FIM rules over one sample, drawing from the generator it is given."""

    def __init__(self, flags: FimFlags, ids: FimTokenIds, tokenizer: FimTokenizer):
        self.flags, self.ids, self.tokenizer = flags, ids, tokenizer

    def __call__(self, sample: numpy.ndarray, rng: numpy.random.RandomState) -> numpy.ndarray:
        """The sample rewritten, at its length: each end-of-document segment on its own."""
        length, eod = sample.shape[0], self.ids.eod
        breaks = numpy.flatnonzero(sample == eod)
        if breaks.size == 0:
            out = self._segment(sample, rng)
        else:
            pieces: list = []
            start = 0
            for stop in breaks.tolist():
                if stop > start:  # an empty segment drops its end-of-document, as in Megatron-LM
                    pieces += [self._segment(sample[start:stop], rng), [eod]]
                start = stop + 1
            pieces.append(self._segment(sample[start:], rng))
            out = numpy.concatenate(pieces)
        if out.shape[0] >= length:
            return numpy.asarray(out[:length], dtype=numpy.int64)
        padding = numpy.full(length - out.shape[0], self.ids.pad)
        return numpy.concatenate([out, padding]).astype(numpy.int64)

    def _segment(self, segment: numpy.ndarray, rng) -> numpy.ndarray:
        """With --fim-split-sample, one draw decides for the segment, then each fragment
        between split tokens is transformed at --fim-fragment-rate."""
        split = self.ids.split
        if split is None:
            return self._permute(segment, self.flags.rate, rng)
        breaks = numpy.flatnonzero(segment == split)
        if breaks.size == 0:
            return self._permute(segment, self.flags.rate, rng)
        if not rng.binomial(1, self.flags.rate):
            return segment
        pieces: list = []
        start = 0
        for stop in breaks.tolist():
            if stop > start:
                pieces += [self._permute(segment[start:stop], self.flags.fragment_rate, rng), [split]]
            start = stop + 1
        pieces.append(self._permute(segment[start:], self.flags.fragment_rate, rng))
        return numpy.concatenate(pieces)

    def _permute(self, tokens: numpy.ndarray, rate, rng) -> numpy.ndarray:
        """Draw order, as Megatron-LM's: take it?, the two cuts, SPM?"""
        if not rng.binomial(1, rate):
            return tokens
        text = self.tokenizer.text_without_specials(tokens.tolist())
        if self.flags.no_prefix is not None and text.startswith(self.flags.no_prefix):
            return tokens
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (self._ids(part) for part in
                                  (text[:low], text[low:high], text[high:]))
        ids = self.ids
        parts: list
        if rng.binomial(1, self.flags.spm_rate):
            parts = [[ids.prefix, ids.suffix], suffix, [ids.middle], prefix, middle]
        else:
            parts = [[ids.prefix], prefix, [ids.suffix], suffix, [ids.middle], middle]
        return numpy.concatenate(parts)

    def _ids(self, text: str) -> numpy.ndarray:
        return numpy.array(self.tokenizer.tokenize(text), dtype=numpy.int64)
