"""Dataset sizes, validate_data's user errors, and megatron-core dataset building without collectives."""

import argparse
import collections
import json

import numpy
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.config.io import DataConfig
from megatron.training.data.datasets import DataError, build_datasets, validate_data
from megatron.training.data.tokenizer import NullTokenizer

pytestmark = pytest.mark.timeout(120)

EOD = 1000
TOKENIZER = NullTokenizer(EOD)  # ids 0..999, eod 1000


def make_prefix(directory, name, documents) -> str:
    """Write documents (lists of token ids) as an indexed dataset; return its prefix."""
    prefix = str(directory / name)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for document in documents:
        builder.add_document(numpy.asarray(document), [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def documents_in_range(low, count=40, length=30):
    """Documents whose tokens lie in [low, low + 100) and end with eod."""
    rng = numpy.random.default_rng(low)
    return [list(rng.integers(low, low + 100, size=length)) + [EOD] for _ in range(count)]


def make_args(**overrides) -> DataConfig:
    values = dict(data_path=None, split="90,5,5", mock_data=False, seq_length=16, seed=1234,
                  data_cache_path=None, reset_position_ids=False, reset_attention_mask=False,
                  eod_mask_loss=False, train_iters=20, global_batch_size=4, eval_interval=10,
                  eval_iters=2, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                  train_samples=None, create_attention_mask_in_dataloader=True,
                  mmap_bin_files=True, data_args_path=None, train_data_path=None,
                  valid_data_path=None, test_data_path=None, per_split_data_args_path=None,
                  num_dataset_builder_threads=1, mid_level_dataset_surplus=0.005, fim_data=False)
    values.update(overrides)
    return DataConfig.from_args(argparse.Namespace(**values))


@pytest.fixture
def prefix(tmp_path):
    return make_prefix(tmp_path, "corpus", documents_in_range(0))


def tokens(dataset, count=10):
    return [dataset[i]["tokens"].tolist() for i in range(count)]


def data_error(args) -> DataError:
    with pytest.raises(DataError) as info:
        validate_data(args)
    assert info.value.fix
    return info.value


def test_dataset_sizes_follow_megatron():
    args = make_args(train_iters=100, global_batch_size=8, eval_interval=30, eval_iters=5)
    assert args.sizes == (800, (100 // 30 + 1) * 5 * 8, 40)


def test_valid_data_passes_and_builds(prefix):
    args = make_args(data_path=[prefix])
    validate_data(args)
    train, valid, test = build_datasets(args, TOKENIZER)
    train_n, valid_n, test_n = args.sizes
    assert len(train) >= train_n and len(valid) >= valid_n and len(test) >= test_n
    item = train[0]
    assert item["tokens"].shape == (16,) and item["labels"].shape == (16,)
    assert set(item) >= {"tokens", "labels", "loss_mask", "position_ids"}


def test_missing_bin_and_idx(prefix, tmp_path):
    for suffix in (".bin", ".idx"):
        args = make_args(data_path=[make_prefix(tmp_path, "p" + suffix[1:], [[1, 2, EOD]])])
        (tmp_path / f"p{suffix[1:]}{suffix}").unlink()
        error = data_error(args)
        assert error.flag == "--data-path" and suffix in error.message


def test_prefix_given_with_suffix_says_so(prefix):
    error = data_error(make_args(data_path=[prefix + ".bin"]))
    assert error.flag == "--data-path" and "without the .bin suffix" in error.fix


def test_truncated_bin(prefix):
    with open(prefix + ".bin", "r+b") as stream:
        stream.truncate(stream.seek(0, 2) - 2)
    error = data_error(make_args(data_path=[prefix]))
    assert error.flag == "--data-path" and "truncated" in error.message


@pytest.mark.parametrize("damage", ["magic", "dtype", "short"])
def test_corrupt_idx(prefix, damage):
    path = prefix + ".idx"
    data = bytearray(open(path, "rb").read())
    if damage == "magic":
        data[0:4] = b"XXXX"
    elif damage == "dtype":
        data[17] = 99  # dtype code byte after magic(9) + version(8)
    else:
        data = data[:-5]
    open(path, "wb").write(bytes(data))
    error = data_error(make_args(data_path=[prefix]))
    assert error.flag == "--data-path" and "corrupt" in error.message


@pytest.mark.timeout(60)  # a hang fails by the timeout; no wall-clock assertion on a shared machine
def test_zero_document_split_fails_fast_instead_of_hanging(tmp_path):
    # 3 documents with --split 98,1,1: valid and test round to 0 documents each. megatron-core's
    # GPTDataset would loop forever here (it keeps adding empty epochs to reach the sample count).
    small = make_prefix(tmp_path, "small", documents_in_range(0, count=3))
    error = data_error(make_args(data_path=[small], split="98,1,1"))
    assert error.flag == "--split" and "valid" in error.message and "0 of the 3" in error.message
    with pytest.raises(DataError):  # build_datasets validates too: it never reaches megatron-core
        build_datasets(make_args(data_path=[small], split="98,1,1"), TOKENIZER)


def test_zero_share_split_is_skipped_like_megatron(tmp_path):
    small = make_prefix(tmp_path, "small", documents_in_range(0, count=3))
    args = make_args(data_path=[small], split="100,0,0")
    validate_data(args)
    train, valid, test = build_datasets(args, TOKENIZER)
    assert train is not None and valid is None and test is None


@pytest.mark.parametrize("data_path, needle", [
    (["0.5", "A", "x", "B"], "'x'"),
    (["0", "A", "1", "B"], "'0'"),
    (["-1", "A", "1", "B"], "'-1'"),
    (["nan", "A", "1", "B"], "'nan'"),
    (["0.5", "A", "B"], "'0.5'"),
    ([], "no training data"),
])
def test_bad_blend(data_path, needle):
    error = data_error(make_args(data_path=data_path))
    assert error.flag == "--data-path" and needle in error.message


@pytest.mark.parametrize("split", ["a,b", "0,0,0", "1,2,3,4", "90,-5,5"])
def test_bad_split_string(prefix, split):
    assert data_error(make_args(data_path=[prefix], split=split)).flag == "--split"


def test_unwritable_cache_dir(prefix, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    error = data_error(make_args(data_path=[prefix], data_cache_path=str(blocker / "cache")))
    assert error.flag == "--data-cache-path"


def test_blend_honours_weights(tmp_path):
    low = make_prefix(tmp_path, "low", documents_in_range(0))
    high = make_prefix(tmp_path, "high", documents_in_range(500))
    args = make_args(data_path=["0.25", low, "0.75", high], train_iters=100, global_batch_size=4)
    train, _, _ = build_datasets(args, TOKENIZER)
    counts = collections.Counter()
    for i in range(400):
        item = train[i]
        source = int(item["dataset_id"])
        counts[source] += 1
        content = item["tokens"][item["tokens"] != EOD]
        assert bool(((content >= 500) == bool(source)).all())  # dataset_id names the real source
    assert abs(counts[0] / 400 - 0.25) < 0.02 and abs(counts[1] / 400 - 0.75) < 0.02


@pytest.mark.parametrize("from_file", [False, True], ids=["flags", "json"])
def test_each_split_reads_its_own_blend(tmp_path, from_file):
    """--train-data-path / --valid-data-path (or --per-split-data-args-path's JSON): the splits
    come from their own files whole (no --split); a missing file names the split's flag."""
    train = make_prefix(tmp_path, "train", documents_in_range(0))
    valid = make_prefix(tmp_path, "valid", documents_in_range(500))
    if from_file:
        table = tmp_path / "splits.json"
        table.write_text(json.dumps({"train": f"1 {train}", "valid": [valid], "test": None}))
        per_split = dict(per_split_data_args_path=str(table))
    else:
        per_split = dict(train_data_path=["1", train], valid_data_path=[valid])
    args = make_args(split=None, **per_split)
    assert args.sources.per_split is not None and args.sources.blend is None
    train_ds, valid_ds, test_ds = build_datasets(args, TOKENIZER)
    assert test_ds is None
    assert all(int(train_ds[i]["tokens"][train_ds[i]["tokens"] != EOD].max()) < 100
               for i in range(20))
    assert all(int(valid_ds[i]["tokens"][valid_ds[i]["tokens"] != EOD].min()) >= 500
               for i in range(8))
    if not from_file:
        error = data_error(make_args(split=None, train_data_path=[train],
                                     valid_data_path=[str(tmp_path / "gone")]))
        assert error.flag == "--valid-data-path"


def test_no_mmap_bin_files_reads_the_same_samples_without_a_memory_map(prefix):
    mapped, _, _ = build_datasets(make_args(data_path=[prefix]), TOKENIZER)
    read, _, _ = build_datasets(make_args(data_path=[prefix], mmap_bin_files=False), TOKENIZER)
    assert tokens(read) == tokens(mapped)
    assert read.dataset.mmap is False and mapped.dataset.mmap is True  # megatron-core's reader
    assert type(read.dataset.bin_reader).__name__ != type(mapped.dataset.bin_reader).__name__


def test_same_args_same_order_and_seed_matters(prefix):
    first, _, _ = build_datasets(make_args(data_path=[prefix]), TOKENIZER)
    again, _, _ = build_datasets(make_args(data_path=[prefix]), TOKENIZER)
    other, _, _ = build_datasets(make_args(data_path=[prefix], seed=7), TOKENIZER)
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


def test_builds_on_any_rank_without_collectives(tmp_path, monkeypatch):
    # Pretend to be rank 1 of a live job: the stock builder would barrier here (and read rank 0's cache).
    def no_collectives(*args, **kwargs):
        raise AssertionError("dataset building must not call a collective")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "barrier", no_collectives)
    low = make_prefix(tmp_path, "low", documents_in_range(0))
    high = make_prefix(tmp_path, "high", documents_in_range(500))
    single, _, _ = build_datasets(make_args(data_path=[low]), TOKENIZER)
    blend, _, _ = build_datasets(make_args(data_path=["1", low, "1", high]), TOKENIZER)
    assert len(single) > 0 and len(blend) > 0
    assert not (tmp_path / "low").exists()  # megatron-core's default <prefix>/cache was not used


def test_cache_is_published_atomically_and_reused(prefix, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    args = make_args(data_path=[prefix], data_cache_path=str(cache))
    built, _, _ = build_datasets(args, TOKENIZER)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 3 and not any(name.startswith(".") for name in entries)

    def must_not_rebuild(self):
        raise AssertionError("cache entry was not reused")

    with monkeypatch.context() as patch:
        patch.setattr(GPTDataset, "_build_document_sample_shuffle_indices", must_not_rebuild)
        cached, _, _ = build_datasets(args, TOKENIZER)
    assert tokens(cached) == tokens(built)

    # A rank that loses the publishing race keeps its arrays in memory and leaves no staging dir.
    from megatron.training.data import datasets
    datasets._publish_entry(str(cache / entries[0]), (numpy.zeros(1),) * 3)
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert numpy.load(cache / entries[0] / "document_index.npy").shape != (1,)

    # Re-preprocessed data under the same prefix must not hit the old entries.
    make_prefix(tmp_path, "corpus", documents_in_range(0, length=50))
    build_datasets(args, TOKENIZER)
    assert len(list(cache.iterdir())) == 6


def test_eod_mask_loss_reaches_megatron(prefix):
    train, _, _ = build_datasets(make_args(data_path=[prefix], eod_mask_loss=True), TOKENIZER)
    item = next(train[i] for i in range(len(train)) if bool((train[i]["tokens"] == EOD).any()))
    at_eod = item["tokens"] == EOD
    assert bool((item["loss_mask"][at_eod] == 0).all()) and bool((item["loss_mask"][~at_eod] == 1).all())


def test_mock_data_items_have_seq_length_tokens():
    args = make_args(mock_data=True, seq_length=24)
    validate_data(args)  # nothing to check for mock data
    train, valid, test = build_datasets(args, TOKENIZER)
    for dataset, requested in zip((train, valid, test), args.sizes):
        assert len(dataset) >= requested
    item = train[3]
    assert item["tokens"].shape == (24,) and item["labels"].shape == (24,)
    assert torch.equal(item["labels"][:-1], item["tokens"][1:])  # labels are the next tokens
    assert int(item["tokens"].max()) <= EOD


def test_a_per_split_file_without_every_split_is_one_error(tmp_path):
    from megatron.training.errors import ArgumentError
    table = tmp_path / "splits.json"
    table.write_text(json.dumps({"train": ["a"], "valid": ["b"]}))
    with pytest.raises(ArgumentError) as err:
        make_args(split=None, per_split_data_args_path=str(table))
    assert err.value.flag == "--per-split-data-args-path" and "test" in str(err.value)


def test_a_blend_built_on_threads_reads_the_same_samples(tmp_path, monkeypatch):
    """--num-dataset-builder-threads: the prefixes are built on that many threads (counted), in
    blend order, so the samples are those of a serial build."""
    import threading
    from megatron.training.data import datasets
    low = make_prefix(tmp_path, "low", documents_in_range(0))
    high = make_prefix(tmp_path, "high", documents_in_range(500))
    threads: set[str] = set()
    build = datasets._LocalBuilder._build_megatron_dataset_splits
    # in the threaded build, both prefixes must be under way at once: a pool that ran them one
    # after the other (or one that reused its first thread) breaks the barrier; without it, a
    # first build finishing before the second was submitted made this test flaky under load
    both_at_once = threading.Barrier(2, timeout=30)
    threaded_build = [False]

    def recording(self, *args):
        threads.add(threading.current_thread().name)
        if threaded_build[0]:
            both_at_once.wait()
        return build(self, *args)
    monkeypatch.setattr(datasets._LocalBuilder, "_build_megatron_dataset_splits", recording)
    blend = ["0.5", low, "0.5", high]
    serial, _, _ = build_datasets(make_args(data_path=blend), TOKENIZER)
    assert len(threads) == 1
    threads.clear()
    threaded_build[0] = True
    threaded, _, _ = build_datasets(make_args(data_path=blend, num_dataset_builder_threads=2),
                                    TOKENIZER)
    assert len(threads) == 2 and tokens(threaded, 40) == tokens(serial, 40)


def test_mid_level_dataset_surplus_sizes_a_blends_datasets(tmp_path):
    """Each dataset of a blend builds its weight's share of the samples plus the surplus
    (megatron-core's rule) in whole epochs of its documents: 40 x 1.005 samples fit in one (69
    here), 40 x 2 (a surplus of 1) need two (139)."""
    low = make_prefix(tmp_path, "low", documents_in_range(0))
    high = make_prefix(tmp_path, "high", documents_in_range(500))
    blend = ["0.5", low, "0.5", high]
    default, _, _ = build_datasets(make_args(data_path=blend), TOKENIZER)
    larger, _, _ = build_datasets(make_args(data_path=blend, mid_level_dataset_surplus=1.0),
                                  TOKENIZER)
    assert [len(d) for d in default.datasets] == [69, 69]
    assert [len(d) for d in larger.datasets] == [139, 139]  # two epochs of its documents


@pytest.mark.parametrize("flag,value", [("--num-dataset-builder-threads", "0"),
                                        ("--mid-level-dataset-surplus", "-0.1")])
def test_bad_dataset_builder_values_are_one_line(flag, value, capsys):
    from megatron.training.arguments import parse_and_validate
    from tests._launch_util import TINY_GPT
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", flag, value], world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and f"error: {flag}: " in err, err
