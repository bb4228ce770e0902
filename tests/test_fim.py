"""Fill-in-the-middle data (`--fim-data`): Megatron-LM's rewrite of each sample, drawn from a
generator of the sample's own, so a sample is the same whoever reads it and in whatever order;
a DP 2 job with a rank killed keeps one process's losses."""
from __future__ import annotations

import json

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.training.arguments import parse_and_validate
from megatron.training.config.io import DataConfig, FimFlags, TokenizerConfig
from megatron.training.data.datasets import build_datasets, validate_data
from megatron.training.data.fim import (
    FillInTheMiddle, FimTokenIds, resolve_token_ids, sample_generator)
from megatron.training.data.tokenizer import build_tokenizer
from megatron.training.errors import UserError
from tests._launch_util import TINY_GPT, launch
from tests.test_tokenizer import write_tiny_bpe

FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
EOD, SPLIT = 5, 6
IDS = FimTokenIds(prefix=1, middle=2, suffix=3, pad=4, eod=EOD, split=None)


class Characters:
    """One token per character (ids are code points); ids below 32 are the sentinels."""
    unknown_id = None

    def token_id(self, token):
        return {"|": SPLIT}.get(token)

    def text_without_specials(self, ids):
        return "".join(chr(i) for i in ids if i >= 32)

    def tokenize(self, text):
        return [ord(c) for c in text]


def reference(sample, rng, rate, spm_rate, split=None, fragment_rate=None):
    """Megatron-LM's GPTFIMDataset rules written out again: segments at end-of-document (an
    empty one loses its end-of-document too), fragments at the split token after one draw for
    the segment, and per piece: take it?, two cuts, SPM?; then cut or pad to the length."""
    def permute(piece, p):
        if not rng.binomial(1, p):
            return list(piece)
        text = "".join(chr(t) for t in piece)
        low, high = sorted(rng.randint(0, len(text) + 1, size=2))
        pre, mid, suf = ([ord(c) for c in part] for part in (text[:low], text[low:high], text[high:]))
        if rng.binomial(1, spm_rate):
            return [1, 3, *suf, 2, *pre, *mid]
        return [1, *pre, 3, *suf, 2, *mid]

    def segment(piece):
        if split is None or split not in piece:
            return permute(piece, rate)
        if not rng.binomial(1, rate):
            return list(piece)
        fragments = "".join(chr(t) for t in piece).split(chr(split))
        out = []
        for n, fragment in enumerate(fragments):
            last = n == len(fragments) - 1
            if fragment or last:
                out += permute([ord(c) for c in fragment], fragment_rate) + ([] if last else [split])
        return out

    pieces = "".join(chr(t) for t in sample).split(chr(EOD))
    out = []
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        if piece or last:
            out += segment([ord(c) for c in piece]) + ([] if last else [EOD])
    return (out + [IDS.pad] * len(sample))[:len(sample)]


def chars(text):
    return numpy.array([EOD if c == "~" else ord(c) for c in text], dtype=numpy.int64)


@pytest.mark.parametrize("rate, spm_rate", [(0.7, 0.5), (1.0, 0.0), (1.0, 1.0)])
def test_each_segment_is_rewritten_with_megatron_lms_draws(rate, spm_rate):
    fim = FillInTheMiddle(FimFlags(rate, spm_rate), IDS, Characters())
    sample = chars("def add(a, b):~return a + b~~x = 1")
    kinds = set()
    for index in range(40):
        got = fim(sample, sample_generator(1234, index)).tolist()
        assert got == reference(sample, sample_generator(1234, index), rate, spm_rate), index
        kinds |= {"spm" if t[:2] == [1, 3] else "psm" if t[:1] == [1] else "kept"
                  for t in map(list, numpy.split(numpy.array(got), numpy.flatnonzero(
                      numpy.array(got) == EOD) + 1))}
    expected = {(0.7, 0.5): {"spm", "psm", "kept"}, (1.0, 0.0): {"psm"}, (1.0, 1.0): {"spm"}}
    assert kinds >= expected[(rate, spm_rate)], kinds


def test_fragments_are_rewritten_each_at_the_fragment_rate():
    ids = FimTokenIds(1, 2, 3, 4, EOD, split=SPLIT)
    flags = FimFlags(0.8, 0.5, split_sample="|", fragment_rate=0.6)
    fim = FillInTheMiddle(flags, ids, Characters())
    sample = numpy.array([*chars("import os"), SPLIT, *chars("x = 1"), SPLIT, SPLIT,
                          *chars("print(x)~tail")])
    for index in range(40):
        got = fim(sample, sample_generator(7, index)).tolist()
        assert got == reference(sample, sample_generator(7, index), 0.8, 0.5, SPLIT, 0.6), index


def test_empty_segments_drop_their_end_of_document_and_the_sample_is_padded():
    fim = FillInTheMiddle(FimFlags(0.0, 0.5), IDS, Characters())
    assert fim(chars("~~ab"), sample_generator(0, 0)).tolist() == [*chars("ab"), 4, 4]


def test_a_segment_starting_with_the_no_fim_prefix_is_left_alone():
    fim = FillInTheMiddle(FimFlags(1.0, 0.5, no_prefix="#!"), IDS, Characters())
    assert fim(chars("#!/bin/sh"), sample_generator(0, 3)).tolist() == chars("#!/bin/sh").tolist()


def test_a_token_outside_the_vocabulary_is_the_unknown_token_or_one_line():
    class Gpt2Like(Characters):
        unknown_id = 50256
    ids, notes = resolve_token_ids(FimFlags(0.5, 0.5), Gpt2Like(), Gpt2Like.unknown_id)
    assert (ids.prefix, ids.pad) == (50256, 50256) and len(notes) == 5
    assert notes[0].startswith("--fim-prefix-token '<fim_prefix>' is not in the vocabulary")
    with pytest.raises(UserError) as info:
        resolve_token_ids(FimFlags(0.5, 0.5), Characters(), None)
    assert info.value.flag == "--fim-prefix-token"


def test_a_huggingface_tokenizer_gives_text_without_its_specials_and_names_a_missing_sentinel(
        tmp_path):
    """Megatron-LM's ids_to_text(remove_special_tokens=True) drops <s> and </s>; a tokenizer
    without an unknown token cannot stand in for a missing sentinel."""
    from tests.test_preprocess import write_hf_tokenizer
    tokenizer = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer",
                                                model=str(write_hf_tokenizer(tmp_path / "hf"))))
    ids = tokenizer.tokenize("hello world")
    assert ids[0] == tokenizer.token_id("<s>")  # its post-processor's
    text = tokenizer.text_without_specials([*ids, tokenizer.eod])
    assert "<s>" not in text and "</s>" not in text and text.replace(" ", "") == "helloworld"
    with pytest.raises(UserError) as info:
        resolve_token_ids(FimFlags(0.5, 0.5), tokenizer, tokenizer.unknown_id)
    assert info.value.flag == "--fim-prefix-token"


# --- the dataset and the job -------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny GPT-2 style BPE with the FIM sentinels, and code-like documents written with it."""
    directory = tmp_path_factory.mktemp("fim")
    vocab_file, merge_file = write_tiny_bpe(directory)
    vocab = json.loads(open(vocab_file).read())
    vocab.update({token: len(vocab) + n for n, token in enumerate(FIM_TOKENS)})
    open(vocab_file, "w").write(json.dumps(vocab))
    tokenizer = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab_file,
                                                merge_file=merge_file))
    prefix = str(directory / "code_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(0)
    for n in range(80):
        text = "".join(f"def f{n}_{k}(x):\n    return x * {int(rng.integers(100))}\n"
                       for k in range(int(rng.integers(1, 4))))
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_document(numpy.array(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    flags = ["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", vocab_file, "--merge-file", merge_file]
    return flags, tokenizer


def data_config(corpus, *extra):
    model = [f for f in TINY_GPT if f not in ("--mock-data", "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "250")]
    args = parse_and_validate([*model, "--train-iters", "20", *corpus[0], *extra], world_size=1)
    return DataConfig.from_args(args)


def test_a_sample_is_the_same_whoever_reads_it_in_whatever_order(corpus):
    fim_data = data_config(corpus, "--fim-data", "--fim-rate", "0.9")
    assert validate_data(fim_data, corpus[1]) == []  # the sentinels are in this vocabulary
    first, second, plain = (build_datasets(d, corpus[1])[0] for d in
                            (fim_data, fim_data, data_config(corpus)))
    count = 60
    in_order = [first[i]["tokens"].tolist() for i in range(count)]
    backwards = {i: second[i]["tokens"].tolist() for i in reversed(range(count))}
    assert in_order == [backwards[i] for i in range(count)]
    rewritten = sum(tokens != plain[i]["tokens"].tolist() for i, tokens in enumerate(in_order))
    assert rewritten > count // 2, rewritten
    prefix_id = corpus[1].token_id("<fim_prefix>")
    assert sum(prefix_id in tokens for tokens in in_order) == rewritten


@pytest.mark.parametrize("given, said", [
    (["--fim-split-sample", "|"], "--fim-fragment-rate: --fim-split-sample rewrites"),
    (["--fim-rate", "1.5"], "--fim-rate 1.5 is not a probability"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"], "NullTokenizer does not give")])
def test_fim_flags_that_cannot_be_taken_are_one_line(corpus, given, said, capsys):
    model = [f for f in TINY_GPT if f != "--mock-data"]
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*model, "--train-iters", "2", *corpus[0], "--fim-data", *given], 1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and said in err, err


def test_fim_data_without_text_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", "--fim-data"], world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--mock-data has none" in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_rank_in_a_fim_job_keeps_one_process_losses(corpus, tmp_path):
    """DP 2, rank 1 killed in a backward of iteration 2: replica 0 reads rank 1's samples in the
    same iteration, and gets the same rewrites. A run without --fim-data shows they are there."""
    model = [f for f in TINY_GPT if f not in ("--mock-data", "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", "250")]
    flags = [*model, "--train-iters", "3", *corpus[0], "--recover-balance", "even"]
    fim = [*flags, "--fim-data", "--fim-rate", "0.9"]
    runs = [launch(1, fim, tmp_path / "one.jsonl"),
            launch(2, [*fim, "--recover-spares", "off", "--inject-fault",
                       "kill:rank=1,iter=2,phase=backward"], tmp_path / "two.jsonl",
                   launcher_args=[]),
            launch(1, flags, tmp_path / "plain.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[1].stdout[-3000:] + runs[1].stderr[-3000:]
    one, two, plain = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert [r["live_replicas"] for r in two] == [[0, 1], [0], [0]]
    for mine, ref in zip(two, one, strict=True):
        assert mine["microbatches"] == 8, mine
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
    assert abs(one[0]["lm_loss"] - plain[0]["lm_loss"]) > 1e-4
