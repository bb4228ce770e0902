"""Tokenize text or JSONL into megatron-core indexed datasets (.bin/.idx), with the flags of
Megatron-LM's tools/preprocess_data.py (`recover-preprocess`, or `python scripts/preprocess_data.py`).

Input: `--input` is a file or a glob. `.json`/`.jsonl` files hold one JSON object per line and every
`--json-keys` field becomes one document; any other file is one document of key `text`.
Output: `<output-prefix>_<key>_document.bin/.idx` per key, as Megatron names them. Files are written
under temporary names and renamed at the end, so a crash or a bad input line leaves nothing behind.
`--partitions N` splits the documents into N contiguous parts tokenized at once by N processes
(each with --workers/N tokenizer processes), then joined in order: the output equals N = 1's.
Bad input: one line on stderr, exit code 2.

    recover-preprocess --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2 --json-keys text
"""

from __future__ import annotations

import collections
import glob
import json
import multiprocessing
import os
import queue as queue_module
import sys
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

from megatron.training.errors import UserError
from megatron.training.tools.preprocess.flags import parse_args
from megatron.training.config.io import TokenizerConfig
from megatron.training.data.tokenizer import build_tokenizer
from recover_patches.log import hide_library_notes

hide_library_notes()  # megatron-core's GPU-library notes: irrelevant for data work

JSON_SUFFIXES = (".json", ".jsonl")
CHUNK_DOCUMENTS = 64  # documents per tokenization task: large enough to amortise IPC

Document = tuple[dict[str, str], int]  # {key: text}, and its size in input bytes (for progress)
Report = Callable[[int, int], None]  # (documents, input bytes) just done


class InputError(UserError):
    """Unusable input data; reported as one line with exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__("--input", message, "fix the input data, or the flags that read it")


# --- reading: documents in input order, with their size ----------------------------------------


def input_files(pattern: str) -> list[str]:
    files = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
    if not files:
        raise InputError(f"{pattern!r}: no such file")
    return files


def count_documents(files: Iterable[str]) -> int:
    """Documents in the input without parsing it: a non-blank JSON line or a whole text file."""
    count = 0
    for path in files:
        if not path.endswith(JSON_SUFFIXES):
            count += 1
            continue
        with open(path, "rb") as stream:
            count += sum(1 for line in stream if line.strip())
    return count


def read_documents(files: Iterable[str], keys: Sequence[str], first: int = 0,
                   stop: Optional[int] = None) -> Iterator[Document]:
    """Documents first..stop-1 (all by default), in file order then line order."""
    index = -1
    for path in files:
        try:
            if not path.endswith(JSON_SUFFIXES):
                if list(keys) != ["text"]:
                    raise InputError(f"{path}: a plain text file only has key 'text' (--json-keys)")
                index += 1
                if first <= index and (stop is None or index < stop):
                    with open(path, encoding="utf-8") as stream:
                        text = stream.read()
                    yield {"text": text}, os.path.getsize(path)
                continue
            with open(path, encoding="utf-8") as stream:
                for number, line in enumerate(stream, start=1):
                    if not line.strip():
                        continue
                    index += 1
                    if stop is not None and index >= stop:
                        return
                    if index >= first:
                        yield _json_document(path, number, line, keys), len(line.encode("utf-8"))
        except UnicodeDecodeError as error:
            raise InputError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})")
        except OSError as error:
            raise InputError(f"{path}: cannot read ({error.strerror})")


def _json_document(path: str, number: int, line: str, keys: Sequence[str]) -> dict[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise InputError(f"{path}:{number}: expected a JSON object per line")
    document = {}
    for key in keys:
        if not isinstance(record.get(key), str):
            raise InputError(f"{path}:{number}: no string field {key!r} (see --json-keys)")
        document[key] = record[key]
    return document


# --- tokenization, in this process or in a pool of worker processes ---------------------------

_tokenizer = None
_append_eod = False


def _init_tokenizer(tokenizer_args: TokenizerConfig, append_eod: bool) -> None:
    global _tokenizer, _append_eod
    _tokenizer, _append_eod = build_tokenizer(tokenizer_args), append_eod


def _encode_chunk(chunk: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    assert _tokenizer is not None, "_init_tokenizer runs first"
    encoded: list[dict[str, list[int]]] = [{} for _ in chunk]
    for key in chunk[0]:
        for document, ids in zip(encoded, _tokenizer.tokenize_batch([doc[key] for doc in chunk])):
            # Megatron's rule: an empty document stays empty, eod is only appended to content.
            document[key] = ids + [_tokenizer.eod] if ids and _append_eod else ids
    return encoded


def _chunks(documents: Iterable[Document]) -> Iterator[tuple[list[dict[str, str]], int]]:
    chunk: list[dict[str, str]] = []
    size = 0
    for fields, nbytes in documents:
        chunk.append(fields)
        size += nbytes
        if len(chunk) == CHUNK_DOCUMENTS:
            yield chunk, size
            chunk, size = [], 0
    if chunk:
        yield chunk, size


def encoded_chunks(documents: Iterable[Document], tokenizer_args, append_eod: bool,
                   workers: int) -> Iterator[tuple[list[dict[str, list[int]]], int]]:
    """(encoded chunk, its input bytes) in input order. Reading stays in this process, so input
    errors surface here."""
    if workers == 1:
        _init_tokenizer(tokenizer_args, append_eod)
        for chunk, size in _chunks(documents):
            yield _encode_chunk(chunk), size
        return
    # One tokenizer thread per worker: --workers is the parallelism the user asked for.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _init_tokenizer, (tokenizer_args, append_eod)) as pool:
        pending: collections.deque = collections.deque()
        for chunk, size in _chunks(documents):
            pending.append((pool.apply_async(_encode_chunk, (chunk,)), size))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


# --- writing ---------------------------------------------------------------------------------


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def _remove(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        if os.path.exists(prefix + suffix):
            os.remove(prefix + suffix)


def write_indexed(documents: Iterable[Document], tokenizer_args, prefixes: dict[str, str],
                  append_eod: bool, workers: int, report: Report) -> dict[str, int]:
    """Tokenize into <prefix>.bin/.idx per key (finalized, not renamed); return documents per key.
    Empty documents are skipped, as in Megatron."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(build_tokenizer(tokenizer_args).vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
                for key, prefix in prefixes.items()}
    written = dict.fromkeys(prefixes, 0)
    try:
        for chunk, size in encoded_chunks(documents, tokenizer_args, append_eod, workers):
            for document in chunk:
                for key, ids in document.items():
                    if ids:
                        builders[key].add_document(numpy.asarray(ids), [len(ids)])
                        written[key] += 1
            report(len(chunk), size)
        for key, prefix in prefixes.items():
            builders[key].finalize(prefix + ".idx")
    finally:
        for builder in builders.values():
            builder.data_file.close()
    return written


class Progress:
    """A tqdm bar over input bytes (MB/s, ETA) with documents and documents/s beside it, moved every
    --log-interval documents."""

    def __init__(self, total_bytes: int, log_interval: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                        desc="tokenizing", mininterval=0, miniters=1)
        self.log_interval, self.start = log_interval, time.monotonic()
        self.documents = self.shown = self.pending_bytes = 0

    def __call__(self, documents: int, nbytes: int) -> None:
        self.documents += documents
        self.pending_bytes += nbytes
        if self.documents - self.shown >= self.log_interval:
            self.flush()

    def flush(self) -> None:
        rate = self.documents / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.documents} docs, {rate:.0f} docs/s", refresh=False)
        self.bar.update(self.pending_bytes)
        self.shown, self.pending_bytes = self.documents, 0

    def close(self) -> None:
        if self.documents > self.shown:
            self.flush()
        self.bar.close()


def _partition_main(files, keys, first, stop, tokenizer_args, prefixes, append_eod, workers,
                    queue) -> None:
    """One partition's process: its documents into its own files; every message goes to `queue`."""
    try:
        written = write_indexed(read_documents(files, keys, first, stop), tokenizer_args, prefixes,
                                append_eod, workers,
                                lambda docs, size: queue.put(("progress", (docs, size))))
        queue.put(("done", written))
    except UserError as error:
        queue.put(("error", error.message))
    except BaseException as error:  # anything else still ends this partition's wait in the parent
        queue.put(("error", f"partition [{first}, {stop}) failed: {error!r}"))
        raise


def write_partitions(files, keys, tokenizer_args, prefixes, append_eod, workers, partitions,
                     report: Report) -> dict[str, int]:
    """--partitions N: N contiguous document ranges tokenized at once, joined in order into
    `prefixes` with megatron-core's IndexedDatasetBuilder.add_index."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    count = count_documents(files)
    bounds = [count * p // partitions for p in range(partitions + 1)]
    parts = [{key: f"{prefix}.part{p}" for key, prefix in prefixes.items()} for p in range(partitions)]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_partition_main, args=(
        files, keys, bounds[p], bounds[p + 1], tokenizer_args, parts[p], append_eod,
        workers // partitions, queue)) for p in range(partitions)]
    written = dict.fromkeys(prefixes, 0)
    errors: list[str] = []
    try:
        for process in processes:
            process.start()
        finished = 0
        while finished < partitions:
            try:
                kind, payload = queue.get(timeout=1.0)
            except queue_module.Empty:  # a process killed outright (OOM) never reports
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if len(dead) > len(errors):
                    raise InputError(f"a partition process died (exit code {dead[0]})") from None
                continue
            if kind == "progress":
                report(*payload)
                continue
            finished += 1
            if kind == "error":
                errors.append(payload)
            else:
                for key, n in payload.items():
                    written[key] += n
        for process in processes:
            process.join()
        if errors:
            raise InputError(errors[0])
        dtype = DType.optimal_dtype(build_tokenizer(tokenizer_args).vocab_size)
        for key, prefix in prefixes.items():
            builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
            for part in parts:
                builder.add_index(part[key])
            builder.finalize(prefix + ".idx")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
        for part in parts:
            for prefix in part.values():
                _remove(prefix)
    return written


def preprocess(documents: Iterable[Document], tokenizer_args, output_prefix: str,
               keys: Sequence[str], append_eod: bool, workers: int = 1,
               total_bytes: int = 0, log_interval: int = 100, files: Sequence[str] = (),
               partitions: int = 1) -> dict[str, int]:
    """Tokenize into <output_prefix>_<key>_document.bin/.idx; return documents per key. With
    partitions > 1 the documents are read from `files` by the partition processes instead.
    Nothing is left on disk unless every key was written completely."""
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    finals = {key: output_prefix_for(output_prefix, key) for key in keys}
    temps = {key: f"{final}.tmp{os.getpid()}" for key, final in finals.items()}
    progress = Progress(total_bytes, log_interval)
    try:
        if partitions == 1:
            written = write_indexed(documents, tokenizer_args, temps, append_eod, workers, progress)
        else:
            written = write_partitions(list(files), keys, tokenizer_args, temps, append_eod,
                                       workers, partitions, progress)
        progress.close()
        for key in keys:
            if written[key] == 0:
                raise InputError(f"no non-empty {key!r} documents found")
        for key in keys:  # .bin first: a reader only trusts a prefix once its .idx is there
            os.replace(temps[key] + ".bin", finals[key] + ".bin")
            os.replace(temps[key] + ".idx", finals[key] + ".idx")
    finally:
        progress.bar.close()
        for temp in temps.values():
            _remove(temp)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
        tokenizer = TokenizerConfig.from_args(args)
        build_tokenizer(tokenizer)  # fail on bad tokenizer flags before reading anything
        files = input_files(args.input)
        written = preprocess(read_documents(files, args.json_keys), tokenizer, args.output_prefix,
                             args.json_keys, args.append_eod, args.workers,
                             sum(os.path.getsize(path) for path in files), args.log_interval,
                             files, args.partitions)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for key, count in written.items():
        print(f"wrote {count} documents to {output_prefix_for(args.output_prefix, key)}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
