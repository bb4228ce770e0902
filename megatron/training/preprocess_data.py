#!/usr/bin/env python
"""Tokenize text or JSONL into megatron-core indexed datasets (.bin/.idx), with Megatron's flags.

Input: `--input` is a file or a glob. `.json`/`.jsonl` files hold one JSON object per line and every
`--json-keys` field becomes one document; any other file is one document of key `text`.
Output: `<output-prefix>_<key>_document.bin/.idx` per key, as Megatron names them. Files are written
under temporary names and renamed at the end, so a crash or a bad input line leaves nothing behind.
Bad input: one line on stderr, exit code 2.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2 --json-keys text
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import multiprocessing
import os
import sys
import warnings
from typing import Iterable, Iterator, Optional, Sequence

from megatron.training.tokenizer import TokenizerError, build_tokenizer
# megatron-core warns on import that it found no GPU-only libraries: irrelevant for data work.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

JSON_SUFFIXES = (".json", ".jsonl")
CHUNK_DOCUMENTS = 64  # documents per tokenization task: large enough to amortise IPC


class InputError(Exception):
    """Unusable input data; reported as one line with exit code 2."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="input file or glob (.json/.jsonl or text)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to extract")
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer", "NullTokenizer"]
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    group.add_argument("--append-eod", action="store_true", help="end every document with eod")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=None, help="accepted for compatibility")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def input_files(pattern: str) -> list[str]:
    files = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
    if not files:
        raise InputError(f"--input {pattern!r}: no such file")
    return files


def read_documents(files: Iterable[str], keys: Sequence[str]) -> Iterator[dict[str, str]]:
    """Yield {key: text} per document, in file order then line order."""
    for path in files:
        try:
            if not path.endswith(JSON_SUFFIXES):
                if list(keys) != ["text"]:
                    raise InputError(f"{path}: a plain text file only has key 'text' (--json-keys)")
                with open(path, encoding="utf-8") as stream:
                    yield {"text": stream.read()}
                continue
            with open(path, encoding="utf-8") as stream:
                for number, line in enumerate(stream, start=1):
                    if line.strip():
                        yield _json_document(path, number, line, keys)
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


# --- tokenization, in this process or in a pool of --workers processes -----------------------

_tokenizer = None
_append_eod = False


def _init_tokenizer(tokenizer_args: argparse.Namespace, append_eod: bool) -> None:
    global _tokenizer, _append_eod
    _tokenizer, _append_eod = build_tokenizer(tokenizer_args), append_eod


def _encode_chunk(chunk: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    encoded = [{} for _ in chunk]
    for key in chunk[0]:
        for document, ids in zip(encoded, _tokenizer.tokenize_batch([doc[key] for doc in chunk])):
            # Megatron's rule: an empty document stays empty, eod is only appended to content.
            document[key] = ids + [_tokenizer.eod] if ids and _append_eod else ids
    return encoded


def _chunks(documents: Iterable[dict[str, str]]) -> Iterator[list[dict[str, str]]]:
    chunk = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == CHUNK_DOCUMENTS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encoded_chunks(documents, tokenizer_args, append_eod: bool, workers: int) -> Iterator[list]:
    """Encoded chunks in input order. Reading stays in this process, so input errors surface here."""
    if workers == 1:
        _init_tokenizer(tokenizer_args, append_eod)
        yield from map(_encode_chunk, _chunks(documents))
        return
    # One tokenizer thread per worker: --workers is the parallelism the user asked for.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _init_tokenizer, (tokenizer_args, append_eod)) as pool:
        pending = collections.deque()
        for chunk in _chunks(documents):
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- writing ---------------------------------------------------------------------------------


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def preprocess(documents, tokenizer_args, output_prefix: str, keys: Sequence[str],
               append_eod: bool, workers: int = 1, total: Optional[int] = None) -> dict[str, int]:
    """Tokenize `documents` into <output_prefix>_<key>_document.bin/.idx; return documents per key.

    Empty documents are skipped. Nothing is left on disk unless every key was written completely.
    """
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    tokenizer = build_tokenizer(tokenizer_args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    finals = {key: output_prefix_for(output_prefix, key) for key in keys}
    temps = {key: f"{final}.tmp{os.getpid()}" for key, final in finals.items()}
    builders, written = {}, dict.fromkeys(keys, 0)
    try:
        for key in keys:
            builders[key] = IndexedDatasetBuilder(temps[key] + ".bin", dtype=dtype)
        with tqdm(total=total, unit="doc", desc="tokenizing", mininterval=1.0) as progress:
            for chunk in encoded_chunks(documents, tokenizer_args, append_eod, workers):
                for document in chunk:
                    for key, ids in document.items():
                        if ids:
                            builders[key].add_document(numpy.asarray(ids), [len(ids)])
                            written[key] += 1
                progress.update(len(chunk))
        for key in keys:
            if written[key] == 0:
                raise InputError(f"--input: no non-empty {key!r} documents found")
            builders[key].finalize(temps[key] + ".idx")
        for key in keys:  # .bin first: a reader only trusts a prefix once its .idx is there
            os.replace(temps[key] + ".bin", finals[key] + ".bin")
            os.replace(temps[key] + ".idx", finals[key] + ".idx")
    finally:
        for key, builder in builders.items():
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(temps[key] + suffix):
                    os.remove(temps[key] + suffix)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        build_tokenizer(args)  # fail on bad tokenizer flags before reading anything
        files = input_files(args.input)
        total = None if any(f.endswith(JSON_SUFFIXES) for f in files) else len(files)
        documents = read_documents(files, args.json_keys)
        written = preprocess(documents, args, args.output_prefix, args.json_keys,
                             args.append_eod, args.workers, total)
    except (InputError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for key, count in written.items():
        print(f"wrote {count} documents to {output_prefix_for(args.output_prefix, key)}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
