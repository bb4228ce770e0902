"""Megatron-LM's SentencePiece tokenizers (GPTSentencePieceTokenizer, SentencePieceTokenizer,
Llama2Tokenizer): megatron-core's wrapper over a .model file, trained here in a moment. Its ids
are sentencepiece's own, eod is the model's end of sentence, the whitespace flag reaches the
wrapper, and a corpus preprocessed with it trains."""
from __future__ import annotations

import json

import pytest

from megatron.training.config.io import TokenizerConfig
from megatron.training.data.tokenizer import TokenizerError, build_tokenizer
from megatron.training.tools import preprocess as preprocess_data
from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.timeout(120)

LINES = [f"def function_{n}(x):  return x * {n} + {n % 7}" for n in range(300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    import sentencepiece
    directory = tmp_path_factory.mktemp("spm")
    (directory / "corpus.txt").write_text("\n".join(LINES) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "corpus.txt"), model_prefix=str(directory / "tokenizer"),
        vocab_size=120, model_type="bpe", minloglevel=2)
    return str(directory / "tokenizer.model")


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "SentencePieceTokenizer",
                                  "Llama2Tokenizer"])
def test_ids_are_sentencepieces_and_eod_its_end_of_sentence(model, kind):
    import sentencepiece
    reference = sentencepiece.SentencePieceProcessor(model_file=model)
    tokenizer = build_tokenizer(TokenizerConfig(kind, model=model))
    text = LINES[17]
    assert tokenizer.tokenize(text) == reference.encode(text)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == reference.decode(reference.encode(text))
    assert tokenizer.eod == reference.eos_id() and tokenizer.vocab_size == 120


def test_keeping_extra_whitespace_reaches_megatron_cores_wrapper(model):
    text = "return  x   *  2"  # the model's normaliser folds runs of spaces
    folded = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model=model))
    kept = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model=model,
                                           sp_ignore_extra_whitespaces=False))
    assert len(kept.tokenize(text)) > len(folded.tokenize(text))


def test_a_missing_or_bad_model_is_one_error_naming_the_flag(tmp_path):
    for path in (None, str(tmp_path / "absent.model")):
        with pytest.raises(TokenizerError) as missing:
            build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model=path))
        assert missing.value.flag == "--tokenizer-model"
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(TokenizerError) as bad:
        build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model=str(tmp_path / "bad.model")))
    assert "cannot load a SentencePiece model" in bad.value.message


def test_special_tokens_without_the_legacy_wrapper_are_one_line(model, capsys):
    from megatron.training.arguments import parse_and_validate
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", "--tokenizer-type",
                            "GPTSentencePieceTokenizer", "--tokenizer-model", model,
                            "--tokenizer-special-tokens", "<x>"], world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--tokenizer-special-tokens: a SentencePiece model takes" in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_corpus_preprocessed_with_it_trains(model, tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": "\n".join(LINES[i:i + 20])}) + "\n"
                              for i in range(0, 300, 20)))
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    assert preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "code"),
                                 "--append-eod", *flags]) == 0
    model_flags = [f for f in TINY_GPT if f not in ("--mock-data", "--tokenizer-type",
                                                    "NullTokenizer", "--vocab-size", "250")]
    run = launch(1, [*model_flags, "--train-iters", "3", "--data-path",
                     str(tmp_path / "code_text_document"), "--split", "100,0,0", *flags],
                 tmp_path / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    losses = run.losses()
    assert len(losses) == 3 and losses[-1] < losses[0], losses
