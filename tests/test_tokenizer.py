"""Tokenizers: GPT-2 BPE from local files, NullTokenizer, the padded-vocabulary rule, flag errors."""

import json
from pathlib import Path

import pytest

from megatron.training.config.io import TokenizerConfig
from megatron.training.data.tokenizer import (
    EOD_TOKEN,
    NullTokenizer,
    TokenizerError,
    build_tokenizer,
    padded_vocab_size,
)

pytestmark = pytest.mark.timeout(60)

# A hand-made GPT-2 style BPE: the 256 byte symbols plus a few merges whose effect we can predict.
TINY_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]


def write_tiny_bpe(directory: Path) -> tuple[str, str]:
    """Write vocab.json + merges.txt; return their paths."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = symbols + [left + right for left, right in TINY_MERGES] + [EOD_TOKEN]
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps({token: i for i, token in enumerate(tokens)}), encoding="utf-8")
    merge_lines = ["#version: 0.2"] + [f"{left} {right}" for left, right in TINY_MERGES]
    merge_file.write_text("\n".join(merge_lines) + "\n", encoding="utf-8")
    return str(vocab_file), str(merge_file)


def bpe_args(vocab_file, merge_file, **overrides) -> TokenizerConfig:
    values = dict(kind="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    values.update(overrides)
    return TokenizerConfig(**values)


@pytest.fixture
def tiny_bpe(tmp_path):
    return write_tiny_bpe(tmp_path)


def test_bpe_applies_merges_in_rank_order(tiny_bpe):
    tokenizer = build_tokenizer(bpe_args(*tiny_bpe))
    vocab = json.loads(Path(tiny_bpe[0]).read_text())
    expected = [vocab[t] for t in ("hell", "o", "Ġw", "or", "l", "d")]
    assert tokenizer.tokenize("hello world") == expected
    assert tokenizer.vocab_size == len(vocab) == 256 + len(TINY_MERGES) + 1
    assert tokenizer.eod == vocab[EOD_TOKEN]


def test_bpe_round_trips_arbitrary_text(tiny_bpe):
    tokenizer = build_tokenizer(bpe_args(*tiny_bpe))
    text = "def f(x):\n\treturn x  # naïve café — 日本語 🙂\r\n\n"
    ids = tokenizer.tokenize(text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize_batch([text, "hello"]) == [ids, tokenizer.tokenize("hello")]


def test_eod_text_in_documents_is_not_special(tiny_bpe):
    # Megatron's GPT-2 tokenizer does not parse "<|endoftext|>" in raw text: only --append-eod adds it.
    tokenizer = build_tokenizer(bpe_args(*tiny_bpe))
    ids = tokenizer.tokenize(EOD_TOKEN)
    assert tokenizer.eod not in ids and len(ids) == len(EOD_TOKEN)
    assert tokenizer.detokenize([tokenizer.eod]) == EOD_TOKEN


def test_default_tokenizer_type_is_gpt2(tiny_bpe):
    tokenizer = build_tokenizer(bpe_args(*tiny_bpe, kind=None))
    assert tokenizer.tokenize("hello") == build_tokenizer(bpe_args(*tiny_bpe)).tokenize("hello")


def test_unique_identifiers_name_the_files(tiny_bpe):
    ids = build_tokenizer(bpe_args(*tiny_bpe)).unique_identifiers
    assert ids["class"] == "GPT2BPETokenizer" and ids["vocab_file"].endswith("vocab.json")


def test_null_tokenizer_semantics():
    tokenizer = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=1000))
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 1001  # ids 0..999 plus eod
    assert tokenizer.eod == 1000
    assert tokenizer.tokenize("5 7 999") == [5, 7, 999]
    assert tokenizer.detokenize([1, 2, 1000]) == "1 2 1000"


@pytest.mark.parametrize(
    "orig, divisible_by, tp, padded",
    [(50257, 128, 1, 50304), (50257, 128, 8, 51200), (4096, 128, 1, 4096), (4096, 128, 8, 4096),
     (1001, 128, 1, 1024), (1001, 128, 2, 1024), (1025, 128, 2, 1280), (7, 1, 1, 7)],
)
def test_padded_vocab_size_rule(orig, divisible_by, tp, padded):
    assert padded_vocab_size(orig, divisible_by, tp) == padded


def _error(args) -> TokenizerError:
    with pytest.raises(TokenizerError) as info:
        build_tokenizer(args)
    return info.value


def test_missing_vocab_file_names_flag(tiny_bpe, tmp_path):
    assert _error(bpe_args(None, tiny_bpe[1])).flag == "--vocab-file"
    error = _error(bpe_args(str(tmp_path / "absent.json"), tiny_bpe[1]))
    assert error.flag == "--vocab-file" and "absent.json" in error.message and error.fix


def test_missing_merge_file_names_flag(tiny_bpe):
    assert _error(bpe_args(tiny_bpe[0], None)).flag == "--merge-file"


def test_swapped_files_name_merge_flag(tiny_bpe):
    error = _error(bpe_args(tiny_bpe[0], tiny_bpe[0]))
    assert error.flag == "--merge-file" and "vocab" in error.fix


def test_vocab_without_eod_is_rejected(tiny_bpe):
    vocab = json.loads(Path(tiny_bpe[0]).read_text())
    del vocab[EOD_TOKEN]
    Path(tiny_bpe[0]).write_text(json.dumps(vocab))
    error = _error(bpe_args(*tiny_bpe))
    assert error.flag == "--vocab-file" and EOD_TOKEN in error.message


def test_vocab_not_json_is_rejected(tiny_bpe):
    Path(tiny_bpe[0]).write_text("not json")
    assert _error(bpe_args(*tiny_bpe)).flag == "--vocab-file"


def test_null_tokenizer_needs_vocab_size():
    assert _error(TokenizerConfig("NullTokenizer", vocab_size=None)).flag == (
        "--vocab-size"
    )


def test_unknown_tokenizer_type():
    error = _error(TokenizerConfig("BertWordPieceCase"))
    assert error.flag == "--tokenizer-type" and "GPT2BPETokenizer" in error.fix


def tiktoken_vocabulary(tmp_path, merges=(b"ab", b"abc", b" a", b"cd")) -> str:
    """tiktoken's JSON vocabulary as Megatron-LM reads it: every byte, then merges by rank."""
    import base64
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(entries))
    return str(path)


def test_tiktokenizer_is_megatron_cores_with_its_special_ids(tmp_path):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer
    path = tiktoken_vocabulary(tmp_path)
    config = TokenizerConfig("TikTokenizer", model=path, vocab_size=270, tiktoken_pattern="v2",
                             tiktoken_special=10)
    tokenizer = build_tokenizer(config)
    reference = TikTokenTokenizer(path, num_special_tokens=10, pattern="v2", vocab_size=270)
    text = "abc abcd cab"
    ids = tokenizer.tokenize(text)
    assert ids == reference.text_to_ids(text) and min(ids) >= 10  # specials come first
    assert 256 + 10 in ids  # the merge "ab" (rank 256) shifted by the special tokens
    assert tokenizer.detokenize(ids) == text
    assert (tokenizer.vocab_size, tokenizer.eod) == (270, reference.eos_id)


def test_tiktokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(TokenizerConfig("TikTokenizer", model=str(tmp_path / "missing.json")))
    assert err.value.flag == "--tokenizer-model"
    too_big = TokenizerConfig("TikTokenizer", model=tiktoken_vocabulary(tmp_path),
                              vocab_size=5000, tiktoken_special=10)
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(too_big)
    assert err.value.flag == "--tokenizer-model" and "--vocab-size" in str(err.value)


def test_tiktokenizer_from_megatrons_flags(tmp_path):
    from megatron.training.arguments import parse_and_validate
    from tests._launch_util import TINY_GPT
    args = parse_and_validate([*TINY_GPT, "--train-iters", "2", "--tokenizer-type", "TikTokenizer",
                               "--tokenizer-model", tiktoken_vocabulary(tmp_path),
                               "--vocab-size", "270", "--tiktoken-pattern", "v1",
                               "--tiktoken-num-special-tokens", "10"], world_size=1)
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    assert tokenizer.vocab_size == 270 and tokenizer.unique_identifiers["pattern"] == "v1"

