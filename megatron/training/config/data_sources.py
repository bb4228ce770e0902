"""Where the training data comes from, as Megatron-LM reads it: one blend split by --split
(--data-path, or --data-args-path: a file holding that list), or a blend per split
(--train-data-path / --valid-data-path / --test-data-path, or --per-split-data-args-path: a JSON
file with "train", "valid" and "test" lists). A blend is PREFIX ... or W1 PREFIX1 W2 PREFIX2 ...
Every problem is one ArgumentError naming the flag that brought the bad entry."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from megatron.training.errors import ArgumentError

SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
SPLIT_KEYS = ("train", "valid", "test")

Blend = tuple[str, ...]


@dataclass(frozen=True)
class DataSources:
    blend: Blend | None  # one blend for every split (--split divides it)
    per_split: tuple[Blend | None, Blend | None, Blend | None] | None
    blend_flag: str  # the flag to name for the single blend's files
    split_flags: tuple[str, str, str]  # ... and for each split's


def data_sources(args: argparse.Namespace) -> DataSources:
    """The blends the flags give (reading the files they name); ArgumentError when the sources
    clash or a file cannot be read."""
    split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    given = [flag for flag, used in (
        ("--mock-data", args.mock_data), ("--data-path", args.data_path is not None),
        ("--data-args-path", args.data_args_path is not None),
        ("--train-data-path", any(p is not None for p in split_paths)),
        ("--per-split-data-args-path", args.per_split_data_args_path is not None)) if used]
    if len(given) > 1:
        raise ArgumentError(given[0], f"{given[0]} and {given[1]} both give the training data "
                                      "(Megatron-LM takes a single source)",
                            f"drop {given[1]} or {given[0]}")
    if args.data_args_path is not None:
        return DataSources(_read_list(args.data_args_path, "--data-args-path"), None,
                           "--data-args-path", SPLIT_FLAGS)
    if args.per_split_data_args_path is not None:
        flag = "--per-split-data-args-path"
        per_split = _read_per_split(args.per_split_data_args_path)
        return DataSources(None, per_split, flag, (flag, flag, flag))
    if any(p is not None for p in split_paths):
        blends = tuple(None if p is None else tuple(p) for p in split_paths)
        return DataSources(None, (blends[0], blends[1], blends[2]), "--data-path", SPLIT_FLAGS)
    blend = None if args.data_path is None else tuple(args.data_path)
    return DataSources(blend, None, "--data-path", SPLIT_FLAGS)


def _read_list(path: str, flag: str) -> Blend:
    try:
        with open(path) as f:
            entries = tuple(f.read().split())
    except OSError as err:
        raise ArgumentError(flag, f"cannot read {path} ({err.strerror})",
                            f"pass a readable file to {flag}") from None
    if not entries:
        raise ArgumentError(flag, f"{path} names no dataset", "list PREFIX or W PREFIX entries")
    return entries


def _read_per_split(path: str) -> tuple[Blend | None, Blend | None, Blend | None]:
    flag = "--per-split-data-args-path"
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as err:
        raise ArgumentError(flag, f"cannot read {path} as JSON ({err})",
                            'pass a JSON file {"train": [...], "valid": [...], "test": [...]}') \
            from None
    if not isinstance(table, dict) or any(key not in table for key in SPLIT_KEYS):
        raise ArgumentError(flag, f"{path} lacks one of the keys {', '.join(SPLIT_KEYS)}",
                            'pass {"train": [...], "valid": [...], "test": [...]} (null: none)')
    blends = []
    for key in SPLIT_KEYS:
        entry = table[key]
        blends.append(None if entry is None else
                      tuple(entry.split()) if isinstance(entry, str) else tuple(map(str, entry)))
    return blends[0], blends[1], blends[2]
