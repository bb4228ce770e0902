"""megatron.training.tools.preprocess (scripts/preprocess_data.py, recover-preprocess) and scripts/prepare_demo_data.py: round trips, atomic output, bad input."""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from tests.test_tokenizer import bpe_args, write_tiny_bpe

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
prepare_demo_data = importlib.import_module("prepare_demo_data")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training.tools import preprocess as preprocess_data  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TEXTS = ["hello world\n", "def f(x):\n    return x  # café 🙂\n", "", "a" * 300]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def bpe_flags(vocab_file, merge_file):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
            "--merge-file", merge_file]


def read_back(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_jsonl_round_trip(tmp_path):
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    prefix = tmp_path / "out" / "corpus"
    argv = ["--input", str(source), "--output-prefix", str(prefix), "--append-eod", "--workers", "1",
            "--json-keys", "text", *bpe_flags(vocab_file, merge_file)]
    assert preprocess_data.main(argv) == 0

    from megatron.training.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(bpe_args(vocab_file, merge_file))
    non_empty = [t for t in TEXTS if t]  # an empty document is skipped
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in non_empty]
    documents = read_back(f"{prefix}_text_document")
    assert documents == expected
    assert [tokenizer.detokenize(d[:-1]) for d in documents] == non_empty
    assert sorted(p.name for p in prefix.parent.iterdir()) == [
        "corpus_text_document.bin", "corpus_text_document.idx"]


def test_plain_text_files_are_one_document_each_and_null_tokenizer(tmp_path):
    for name, text in [("b.txt", "4 5 6"), ("a.txt", "1 2\n3")]:
        (tmp_path / name).write_text(text)
    prefix = tmp_path / "ids"
    argv = ["--input", str(tmp_path / "*.txt"), "--output-prefix", str(prefix),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    assert preprocess_data.main(argv) == 0
    assert read_back(f"{prefix}_text_document") == [[1, 2, 3], [4, 5, 6]]  # sorted file order


def test_several_json_keys_and_workers_match_single_process(tmp_path):
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    records = [{"text": f"hello {i}", "title": f"world {i}"} for i in range(150)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    outputs = {}
    for workers in ("1", "2"):
        prefix = tmp_path / f"w{workers}"
        argv = ["--input", str(source), "--output-prefix", str(prefix), "--append-eod",
                "--workers", workers, "--json-keys", "text", "title", *bpe_flags(vocab_file, merge_file)]
        assert preprocess_data.main(argv) == 0
        outputs[workers] = [read_back(f"{prefix}_{key}_document") for key in ("text", "title")]
    assert outputs["1"] == outputs["2"]
    assert len(outputs["1"][0]) == len(outputs["1"][1]) == 150


def _run_bad(tmp_path, capsys, argv) -> str:
    assert preprocess_data.main(argv) == 2
    # stderr also carries the progress bar; the diagnosis itself is exactly one line.
    errors = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
              if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


def test_invalid_json_mid_file_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preprocess_data, "CHUNK_DOCUMENTS", 2)  # several chunks written before the error
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(8)] + ["{broken"]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--input", str(source), "--output-prefix", str(out / "c"), *bpe_flags(vocab_file, merge_file)]
    err = _run_bad(tmp_path, capsys, argv)
    assert "in.jsonl:9" in err and "JSON" in err
    assert list(out.iterdir()) == []


def test_missing_key_and_missing_input(tmp_path, capsys):
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = write_jsonl(tmp_path / "in.jsonl", [{"body": "x"}])
    flags = bpe_flags(vocab_file, merge_file)
    err = _run_bad(tmp_path, capsys, ["--input", str(source), "--output-prefix", str(tmp_path / "o"),
                                      *flags])
    assert "'text'" in err and "--json-keys" in err
    err = _run_bad(tmp_path, capsys, ["--input", str(tmp_path / "nope.jsonl"),
                                      "--output-prefix", str(tmp_path / "o"), *flags])
    assert "--input" in err
    assert not list(tmp_path.glob("o_*"))


def test_bad_tokenizer_flag_exits_2(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    err = _run_bad(tmp_path, capsys, ["--input", str(source), "--output-prefix", str(tmp_path / "o"),
                                      "--vocab-file", str(tmp_path / "missing.json")])
    assert "--vocab-file" in err


def test_prepare_demo_data_builds_then_reuses(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--out-dir", str(out), "--max-bytes", "60000", "--vocab-size", "400"]
    assert prepare_demo_data.main(argv) == 0
    first = capsys.readouterr().out
    prefix = out / "stdlib_text_document"
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == 400 and "<|endoftext|>" in vocab
    documents = read_back(str(prefix))
    assert len(documents) > 1 and all(d[-1] == vocab["<|endoftext|>"] for d in documents)
    assert "reusing" not in first and f"--data-path {prefix}" in first

    mtime = (out / "stdlib_text_document.bin").stat().st_mtime_ns
    assert prepare_demo_data.main(argv) == 0
    assert "reusing cached demo data" in capsys.readouterr().out
    assert (out / "stdlib_text_document.bin").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in out.iterdir()) == [
        "merges.txt", "stdlib_text_document.bin", "stdlib_text_document.idx", "vocab.json"]


def test_prepare_demo_data_is_deterministic(tmp_path):
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / name
        prepare_demo_data.main(["--out-dir", str(out), "--max-bytes", "60000", "--vocab-size", "400"])
        outputs.append([(out / f).read_bytes() for f in ("vocab.json", "merges.txt",
                                                         "stdlib_text_document.bin")])
    assert outputs[0] == outputs[1]


def write_hf_tokenizer(directory: Path, eos: str | None = "</s>") -> Path:
    """A small BPE tokenizer.json trained here (offline), whose post-processor prepends <s>, like
    Llama's; tokenizer_config.json names the eos token as transformers writes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["hello world", "the quick brown fox", "jumps over lazy dogs"] * 5,
                                  trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return directory


def test_huggingface_tokenizer_from_a_local_directory(tmp_path, capsys):
    from tokenizers import Tokenizer

    model = write_hf_tokenizer(tmp_path / "hf")
    texts = ["hello world", "the lazy fox"]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "hf_out"), "--append-eod",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model)]
    assert preprocess_data.main(argv) == 0
    reference = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos, eos = reference.token_to_id("<s>"), reference.token_to_id("</s>")
    documents = read_back(f"{tmp_path / 'hf_out'}_text_document")
    assert documents == [reference.encode(t).ids + [eos] for t in texts]
    assert all(d[0] == bos for d in documents)  # the tokenizer's own special tokens, as Megatron

    write_hf_tokenizer(tmp_path / "no_eos", eos=None)
    err = _run_bad(tmp_path, capsys, [*argv[:-1], str(tmp_path / "no_eos")])
    assert "--tokenizer-model" in err and "eos_token" in err


def _many_documents(tmp_path: Path, n: int = 50) -> Path:
    return write_jsonl(tmp_path / "many.jsonl", [{"text": f"hello {i}\nworld"} for i in range(n)])


def test_partitions_give_the_same_files_as_one_and_leave_no_parts(tmp_path):
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = _many_documents(tmp_path, 101)
    outputs = {}
    for partitions, workers in (("1", "1"), ("3", "3")):
        prefix = tmp_path / f"p{partitions}" / "c"
        argv = ["--input", str(source), "--output-prefix", str(prefix), "--append-eod",
                "--workers", workers, "--partitions", partitions, *bpe_flags(vocab_file, merge_file)]
        assert preprocess_data.main(argv) == 0
        outputs[partitions] = [(prefix.parent / f"c_text_document{s}").read_bytes()
                               for s in (".bin", ".idx")]
        assert sorted(p.name for p in prefix.parent.iterdir()) == [
            "c_text_document.bin", "c_text_document.idx"]
    assert outputs["1"] == outputs["3"]
    assert len(read_back(f"{tmp_path / 'p3' / 'c'}_text_document")) == 101


def test_a_bad_line_in_a_later_partition_leaves_nothing(tmp_path, capsys):
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = _many_documents(tmp_path, 20)
    source.write_text(source.read_text() + "{broken\n")
    out = tmp_path / "out"
    err = _run_bad(tmp_path, capsys, ["--input", str(source), "--output-prefix", str(out / "c"),
                                      "--partitions", "2", "--workers", "2",
                                      *bpe_flags(vocab_file, merge_file)])
    assert "many.jsonl:21" in err and "JSON" in err
    assert list(out.iterdir()) == []


def test_refused_and_invalid_runtime_flags_are_one_line(tmp_path, capsys):
    base = ["--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "5"]
    assert "--workers" in _run_bad(tmp_path, capsys, [*base, "--workers", "3", "--partitions", "2"])
    assert "--split-sentences" in _run_bad(tmp_path, capsys, [*base, "--split-sentences"])
    assert "did you mean --partitions" in _run_bad(tmp_path, capsys, [*base, "--partition", "2"])


def test_keep_newlines_keeps_them(tmp_path):
    """Without a sentence splitter (refused) nothing removes newlines: --keep-newlines holds by
    construction, and the documents decode back with every newline."""
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = _many_documents(tmp_path, 3)
    prefix = tmp_path / "nl"
    assert preprocess_data.main(["--input", str(source), "--output-prefix", str(prefix),
                                 "--keep-newlines", *bpe_flags(vocab_file, merge_file)]) == 0
    from megatron.training.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(bpe_args(vocab_file, merge_file))
    decoded = [tokenizer.detokenize(d) for d in read_back(f"{prefix}_text_document")]
    assert decoded == [f"hello {i}\nworld" for i in range(3)]


@pytest.mark.parametrize("interval, shown", [(10, {10, 20, 30, 40, 50}), (25, {25, 50})])
def test_progress_moves_every_log_interval_documents_with_rates(tmp_path, capsys, monkeypatch,
                                                               interval, shown):
    monkeypatch.setattr(preprocess_data, "CHUNK_DOCUMENTS", 5)
    vocab_file, merge_file = write_tiny_bpe(tmp_path)
    source = _many_documents(tmp_path, 50)
    assert preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "o"),
                                 "--log-interval", str(interval),
                                 *bpe_flags(vocab_file, merge_file)]) == 0
    err = capsys.readouterr().err
    assert {int(n) for n in re.findall(r"(\d+) docs, \d+ docs/s", err)} == shown
    assert re.search(r"\d[kMG]?B/s", err), err[-500:]  # input MB/s from tqdm
