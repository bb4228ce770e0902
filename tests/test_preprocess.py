"""megatron.training.preprocess_data (scripts/preprocess_data.py, recover-preprocess) and scripts/prepare_demo_data.py: round trips, atomic output, bad input."""

import importlib
import json
import sys
from pathlib import Path

import pytest

from tests.test_tokenizer import bpe_args, write_tiny_bpe

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
prepare_demo_data = importlib.import_module("prepare_demo_data")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training import preprocess_data  # noqa: E402

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

    from megatron.training.tokenizer import build_tokenizer

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
