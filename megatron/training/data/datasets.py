"""Train/valid/test datasets: megatron-core GPTDataset (one prefix or a weighted blend) or MockGPTDataset.

Two departures from stock Megatron, both for running inside a job whose ranks may die:
* No collectives. Stock building is "rank 0 first, barrier, then the others read rank 0's cache".
  Here every rank builds its own copy in memory (same config -> same numpy seed -> same order), so
  dataset building never waits on a peer that may be gone.
* No cache races. megatron-core writes its index cache non-atomically (under `<prefix>/cache` when
  --data-cache-path is unset). We build in memory; with --data-cache-path each rank reuses a finished
  cache entry or builds and publishes its own with an atomic directory rename.
`validate_data` runs first so bad files and empty splits fail with a clear message instead of an
assertion deep inside megatron-core, or a hang (GPTDataset loops forever on a split with 0 tokens).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType
from megatron.core.datasets.utils import Split
from torch.utils.data import Dataset

from megatron.training.errors import UserError
from megatron.training.config.io import DataConfig
from megatron.training.data.fim import FillInTheMiddle, resolve_token_ids, sample_generator

# .idx layout (megatron-core IndexedDataset): magic(9) version<Q> dtype<B> sequences<Q> documents<Q>,
# then int32 lengths[sequences], int64 byte pointers[sequences], int64 document starts[documents].
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEAD = struct.Struct("<QBQQ")
_IDX_HEAD_BYTES = len(_IDX_MAGIC) + _IDX_HEAD.size
_DEFAULT_SPLIT = "969, 30, 1"
_SPLIT_PART = re.compile(r"\d+(\.\d*)?|\.\d+")
_MAKE_DATA = (
    "run scripts/preprocess_data.py (it writes PREFIX_text_document.bin/.idx) and pass "
    "--data-path PREFIX_text_document"
)


class DataError(UserError):
    """A user error in the data flags."""


def parse_blend(data_path: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """--data-path as Megatron reads it: `P1 [P2 ...]` or `W1 P1 W2 P2 ...` (weights > 0)."""
    entries = [entry.strip() for entry in data_path or [] if entry.strip()]
    if not entries:
        raise DataError("--data-path", "no training data given", f"{_MAKE_DATA}, or use --mock-data")
    if len(entries) % 2 == 0 and _number(entries[0]) is not None:
        weights = [_blend_weight(raw) for raw in entries[0::2]]
        return entries[1::2], weights
    stray = [e for e in entries if _number(e) is not None and not os.path.exists(e + ".idx")]
    if stray:
        raise DataError(
            "--data-path",
            f"{stray[0]!r} looks like a blend weight but the entries do not form WEIGHT PREFIX pairs",
            "give either prefixes only or WEIGHT PREFIX pairs, e.g. --data-path 0.3 A 0.7 B",
        )
    return entries, None


def split_matrix(split: Optional[str]) -> list[Optional[tuple[float, float]]]:
    """Parse --split strictly (megatron-core's parser silently ignores junk), then defer to it."""
    text = _DEFAULT_SPLIT if split is None else str(split)
    parts = [part for part in re.split(r"[,/\s]+", text.strip()) if part]
    if not 1 <= len(parts) <= 3 or not all(_SPLIT_PART.fullmatch(p) for p in parts):
        raise DataError(
            "--split", f"{text!r} is not up to three non-negative numbers", "use e.g. --split 969,30,1"
        )
    if sum(float(p) for p in parts) <= 0:
        raise DataError("--split", f"{text!r} gives every split weight 0", "use e.g. --split 969,30,1")
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(",".join(parts)))


def validate_data(data: DataConfig, tokenizer=None) -> list[str]:
    """Check every data file and the split before building; raise DataError on the first problem.
    Returns the start-up lines of --fim-data's tokens (with the tokenizer)."""
    if data.mock:
        return []
    _check_cache_dir(data.cache_path)
    sources = data.sources
    if sources.per_split is not None:  # each file is wholly its split's
        for flag, blend in zip(sources.split_flags, sources.per_split):
            for prefix in parse_blend(list(blend))[0] if blend else []:
                _read_sequence_lengths(prefix, flag)
    else:
        prefixes, _ = parse_blend(list(sources.blend or ()))
        matrix = split_matrix(data.split)
        for prefix in prefixes:
            lengths = _read_sequence_lengths(prefix, sources.blend_flag)
            _check_splits(prefix, lengths, matrix, data.sizes, data.split or _DEFAULT_SPLIT)
    return [] if tokenizer is None else fill_in_the_middle(data, tokenizer)[1]


def fill_in_the_middle(data: DataConfig, tokenizer) -> tuple[Optional[FillInTheMiddle], list[str]]:
    """--fim-data's transformation (None without it) and its start-up lines."""
    if data.fim is None:
        return None, []
    ids, notes = resolve_token_ids(data.fim, tokenizer, tokenizer.unknown_id)
    return FillInTheMiddle(data.fim, ids, tokenizer), notes


def build_datasets(data: DataConfig, tokenizer
                   ) -> tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """(train, valid, test); a split with share 0 in --split is None, as in Megatron."""
    per_split: list | None = None  # a blend per split: megatron-core takes no --split then
    split: str | None = data.split or _DEFAULT_SPLIT
    if data.mock:
        cls, blend, split = MockGPTDataset, None, _DEFAULT_SPLIT
    else:
        validate_data(data)
        sources = data.sources
        cls = _CachedGPTDataset if data.fim is None else _CachedGPTFIMDataset
        if sources.per_split is None:
            blend = parse_blend(list(sources.blend or ()))
        else:
            blend, split = None, None
            per_split = [parse_blend(list(b)) if b else None for b in sources.per_split]
    config = _IndexCacheConfig(
        random_seed=data.seed,
        sequence_length=data.seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=split,
        # "" rather than None: with None megatron-core caches under <prefix>/cache, racing ranks.
        path_to_cache="",
        index_cache_dir=data.cache_path,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.create_attention_mask,
        mid_level_dataset_surplus=data.mid_level_surplus,
        num_dataset_builder_threads=data.builder_threads,
        mmap_bin_files=data.mmap_bin_files,  # --no-mmap-bin-files: read the .bin with file reads
        fim=fill_in_the_middle(data, tokenizer)[0],
    )
    train, valid, test = _LocalBuilder(cls, list(data.sizes), lambda: True, config).build()
    return train, valid, test


# --- validation helpers ------------------------------------------------------------------------


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _blend_weight(raw: str) -> float:
    weight = _number(raw)
    if weight is None or not math.isfinite(weight) or weight <= 0:
        raise DataError(
            "--data-path",
            f"blend weight {raw!r} is not a positive number",
            "give WEIGHT PREFIX pairs with weights > 0, e.g. --data-path 0.3 A 0.7 B",
        )
    return weight


def _check_cache_dir(path: Optional[str]) -> None:
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise DataError("--data-cache-path", f"cannot create {path}: {error}", "pass a writable dir")
    if not os.access(path, os.W_OK):
        raise DataError("--data-cache-path", f"{path} is not writable", "pass a writable directory")


def _missing_file_fix(prefix: str) -> str:
    stem, suffix = os.path.splitext(prefix)
    if suffix in (".bin", ".idx") and os.path.exists(stem + ".idx"):
        return f"pass the prefix without the {suffix} suffix: {stem}"
    return _MAKE_DATA


def _read_sequence_lengths(prefix: str, flag: str = "--data-path") -> numpy.ndarray:
    """Validate PREFIX.idx/.bin against each other; return the per-sequence token counts."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DataError(flag, f"{path} does not exist", _missing_file_fix(prefix))
    corrupt_fix = f"re-run scripts/preprocess_data.py to rewrite {prefix}.bin/.idx"

    def corrupt(why: str) -> DataError:
        return DataError(flag, f"{idx_path} is corrupt: {why}", corrupt_fix)

    with open(idx_path, "rb") as stream:
        head = stream.read(_IDX_HEAD_BYTES)
    if len(head) < _IDX_HEAD_BYTES or not head.startswith(_IDX_MAGIC):
        raise corrupt("not a megatron-core index (bad header)")
    version, code, sequences, documents = _IDX_HEAD.unpack(head[len(_IDX_MAGIC) :])
    if version != 1:
        raise corrupt(f"unsupported version {version}")
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise corrupt(f"unknown token dtype code {code}") from None
    expected = _IDX_HEAD_BYTES + sequences * (4 + 8) + documents * 8
    actual = os.path.getsize(idx_path)
    if actual not in (expected, expected + sequences):  # + sequences: multimodal mode bytes
        raise corrupt(f"{actual} bytes, but its header describes {expected}")
    if sequences == 0:
        raise DataError(flag, f"{prefix} holds no documents", _MAKE_DATA)
    offset = _IDX_HEAD_BYTES
    lengths = numpy.memmap(idx_path, numpy.int32, "r", offset, (sequences,))
    pointers = numpy.memmap(idx_path, numpy.int64, "r", offset + 4 * sequences, (sequences,))
    doc_starts = numpy.memmap(idx_path, numpy.int64, "r", offset + 12 * sequences, (documents,))
    if documents < 2 or doc_starts[0] != 0 or doc_starts[-1] != sequences or pointers[0] != 0:
        raise corrupt("document and sequence tables disagree")
    if int(lengths.min()) < 0:
        raise corrupt("negative sequence length")
    data_bytes = int(pointers[-1]) + int(lengths[-1]) * itemsize
    bin_bytes = os.path.getsize(bin_path)
    if bin_bytes != data_bytes:
        raise DataError(
            flag,
            f"{bin_path} is {bin_bytes} bytes but {idx_path} describes {data_bytes} "
            "(truncated, or .bin and .idx come from different runs)",
            corrupt_fix,
        )
    return lengths


def _check_splits(prefix, lengths, matrix, sizes, split_text: str) -> None:
    """Every split megatron-core will build must hold >= 1 token, else it loops forever."""
    count = len(lengths)
    for split, bounds, requested in zip(Split, matrix, sizes):
        if bounds is None:
            continue  # share 0: megatron-core builds no dataset for it
        # The same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
        begin, end = int(round(bounds[0] * float(count))), int(round(bounds[1] * float(count)))
        if int(lengths[begin:end].sum(dtype=numpy.int64)) == 0:
            raise DataError(
                "--split",
                f"--split {split_text!r} gives the {split.name} split {end - begin} of the {count} "
                f"documents of {prefix} and no tokens, but {requested} {split.name} samples are "
                "needed (megatron-core would wait forever building it)",
                f"give the {split.name} split a larger share, set its share to 0 to skip it "
                "(e.g. --split 100,0,0), or use more data",
            )


# --- building without collectives, with an atomic index cache --------------------------------


@dataclass
class _IndexCacheConfig(GPTDatasetConfig):
    index_cache_dir: Optional[str] = None
    """--data-cache-path: where finished GPT index arrays are shared between ranks and runs."""
    fim: Optional[FillInTheMiddle] = None
    """--fim-data: the fill-in-the-middle rewrite of each sample."""


class _LocalBuilder(BlendedMegatronDatasetBuilder):
    """Builds every split in this process; unlike the stock builder, calls no barrier."""

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        return cls(*args)

    def _build_megatron_datasets_parallel(self, prefixes, split, sizes_per_dataset):
        """Each prefix's splits, on --num-dataset-builder-threads threads, kept in blend order."""
        def build(prefix, sizes):
            return self._build_megatron_dataset_splits(prefix, split, sizes, False)
        with ThreadPoolExecutor(max_workers=self.config.num_dataset_builder_threads) as pool:
            built_per_prefix = list(pool.map(build, prefixes, sizes_per_dataset))
        per_split: list[list] = [[] for _ in Split]
        for built in built_per_prefix:
            for datasets, dataset in zip(per_split, built):
                datasets.append(dataset)
        return per_split


_INDEX_FILES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy")


class _CachedGPTDataset(GPTDataset):
    """GPTDataset whose index arrays are built in memory or taken from an atomic cache entry."""

    def _build_document_sample_shuffle_indices(self):
        cache_dir = self.config.index_cache_dir
        if not cache_dir:
            return super()._build_document_sample_shuffle_indices()
        # The arrays depend on the document lengths too, which megatron-core's hash leaves out:
        # a re-preprocessed file under the same prefix must not hit a stale entry.
        key = hashlib.md5(
            (self.unique_description_hash + _lengths_digest(self.dataset)).encode()
        ).hexdigest()
        entry = os.path.join(cache_dir, f"{key}-{self.index_split.name}")
        cached = _load_entry(entry)
        if cached is not None:
            return cached
        arrays = super()._build_document_sample_shuffle_indices()
        _publish_entry(entry, arrays)
        return arrays


class _CachedGPTFIMDataset(_CachedGPTDataset):
    """Fill-in-the-middle samples: sample `idx` drawn from its own generator (data/fim.py)."""

    def _query_document_sample_shuffle_indices(self, idx):
        text, documents = super()._query_document_sample_shuffle_indices(idx)
        # megatron-core pads a short last sample; Megatron-LM's FIM rewrites the tokens before it
        stop = len(text)
        while stop and text[stop - 1] == self._pad_token_id:
            stop -= 1
        seed = self.config.random_seed
        rewritten = self.config.fim(text[:stop], sample_generator(seed, idx))
        return numpy.concatenate([rewritten, text[stop:]]), documents


def _lengths_digest(indexed_dataset) -> str:
    digest = getattr(indexed_dataset, "_recover_lengths_md5", None)
    if digest is None:
        lengths = numpy.ascontiguousarray(indexed_dataset.sequence_lengths)
        digest = hashlib.md5(lengths.tobytes()).hexdigest()
        indexed_dataset._recover_lengths_md5 = digest
    return digest


def _load_entry(entry: str):
    if not os.path.isdir(entry):
        return None
    try:
        return tuple(numpy.load(os.path.join(entry, name), mmap_mode="r") for name in _INDEX_FILES)
    except (OSError, ValueError):
        return None  # unreadable entry: rebuild in memory rather than fail the run


def _publish_entry(entry: str, arrays) -> None:
    """Write to a private temp dir, then rename: readers see a whole entry or none."""
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(entry))
    try:
        for name, array in zip(_INDEX_FILES, arrays):
            numpy.save(os.path.join(staging, name), array, allow_pickle=False)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; other users' runs may share the cache
        os.rename(staging, entry)
    except OSError:
        pass  # another rank published the same entry first (or the disk is full): keep ours in RAM
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _DropInMemoryNotice(logging.Filter):
    """megatron-core warns 'Unable to save ... path_to_cache is None' for our deliberate in-memory build."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (("Unable to save" in message or "Cannot save" in message) and "path_to_cache" in message)


for _name in ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset"):
    logging.getLogger(_name).addFilter(_DropInMemoryNotice())
