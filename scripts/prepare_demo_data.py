#!/usr/bin/env python
"""Build the embedded demo corpus: real text available offline on any machine with Python.

Reads this interpreter's standard-library `.py` sources (sorted, capped at --max-bytes), trains a
deterministic byte-level BPE on them, saves it GPT-2 style (vocab.json + merges.txt, with
<|endoftext|>), and preprocesses one document per source file (eod appended) into
OUT_DIR/stdlib_text_document.bin/.idx. Nothing of the stdlib is committed; it is read at run time.
Existing outputs are reused (use --force to rebuild).

    python scripts/prepare_demo_data.py --out-dir data/demo
    # then: --data-path data/demo/stdlib_text_document --vocab-file data/demo/vocab.json \
    #       --merge-file data/demo/merges.txt --tokenizer-type GPT2BPETokenizer
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

# megatron-core warns on import that it found no GPU-only libraries: irrelevant for data work.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
from megatron.training.tools import preprocess as preprocess_data  # noqa: E402

from megatron.training.config.io import TokenizerConfig  # noqa: E402
from megatron.training.data.tokenizer import EOD_TOKEN  # noqa: E402

DATA_NAME = "stdlib"
# 4096 ids: small enough that a tiny GPT's output layer is cheap on CPU and its loss falls within
# minutes, large enough that common Python idioms (indentation runs, "self", keywords) are one token.
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 4 * 2**20
# Only files up to 16 KiB: many documents per MiB, so that even the default --split 969,30,1
# leaves the 0.1% test split at least one document (> 500 documents needed).
MAX_FILE_BYTES = 16 * 2**10
DEFAULT_SPLIT_MIN_DOCUMENTS = 501


def stdlib_sources(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of stdlib .py files in sorted order, until max_bytes is reached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources, total = [], 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if {"site-packages", "dist-packages"} & set(relative.parts):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        sources.append((str(relative), text))
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return sources


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> None:
    """Train byte-level BPE and save vocab.json + merges.txt atomically (both or neither)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    staging = tempfile.mkdtemp(prefix=".tokenizer-", dir=out_dir)
    try:
        tokenizer.model.save(staging)  # writes vocab.json and merges.txt
        # merges.txt last: on a first build, its presence marks a complete tokenizer.
        for name in ("vocab.json", "merges.txt"):
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _import_indexed_dataset() -> None:
    import megatron.core.datasets.indexed_dataset  # noqa: F401


def prepare(out_dir: str, vocab_size: int, max_bytes: int, force: bool) -> str:
    """Build (or reuse) the demo corpus in out_dir; return the --data-path prefix."""
    os.makedirs(out_dir, exist_ok=True)
    vocab_file = os.path.join(out_dir, "vocab.json")
    merge_file = os.path.join(out_dir, "merges.txt")
    prefix = preprocess_data.output_prefix_for(os.path.join(out_dir, DATA_NAME), "text")
    have_tokenizer = os.path.isfile(vocab_file) and os.path.isfile(merge_file)
    have_data = os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    if have_tokenizer and have_data and not force:
        print(f"reusing cached demo data in {out_dir} (--force rebuilds it)")
        return prefix

    start = time.monotonic()
    # Importing megatron.core (torch) costs seconds of CPU; overlap it with reading and BPE training.
    warm_up = threading.Thread(target=_import_indexed_dataset, daemon=True)
    warm_up.start()
    sources = stdlib_sources(max_bytes)
    size = sum(len(text.encode("utf-8")) for _, text in sources)
    print(f"read {len(sources)} stdlib files ({size / 2**20:.1f} MiB) from {sysconfig.get_paths()['stdlib']}")
    if not sources:
        raise SystemExit("error: found no readable standard-library .py files")
    if have_tokenizer and not force:
        print(f"reusing tokenizer {vocab_file} + {merge_file}")
    else:
        print(f"training byte-level BPE, vocab {vocab_size} ...")
        train_tokenizer([text for _, text in sources], vocab_size, out_dir)
    tokenizer_args = TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    warm_up.join()
    documents = (({"text": text}, len(text.encode("utf-8"))) for _, text in sources)
    preprocess_data.preprocess(
        documents, tokenizer_args, os.path.join(out_dir, DATA_NAME), ["text"],
        append_eod=True, workers=1, total_bytes=size, log_interval=500,
    )
    print(f"wrote {prefix}.bin/.idx in {time.monotonic() - start:.1f}s")
    return prefix


def _document_count(prefix: str) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return len(IndexedDataset(prefix))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, help="where the tokenizer and data go")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus cap")
    parser.add_argument("--force", action="store_true", help="rebuild even if outputs exist")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error("--vocab-size must be >= 300 (256 byte symbols + eod + merges)")
    if args.max_bytes < 1:
        parser.error("--max-bytes must be positive")
    prefix = prepare(args.out_dir, args.vocab_size, args.max_bytes, args.force)
    documents = _document_count(prefix)
    split = ""
    if documents < DEFAULT_SPLIT_MIN_DOCUMENTS:
        print(f"note: only {documents} documents, too few for the default --split 969,30,1")
        split = "--split 98,1,1 "
    print(
        f"train with: --data-path {prefix} {split}--tokenizer-type GPT2BPETokenizer "
        f"--vocab-file {os.path.join(args.out_dir, 'vocab.json')} "
        f"--merge-file {os.path.join(args.out_dir, 'merges.txt')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
