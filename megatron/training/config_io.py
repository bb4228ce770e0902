"""Typed configuration of what a run reads: its data (and `config.py`'s model, optimizer and
loop). Like `config.py`: frozen dataclasses built once from the validated flags, each checked
where declared; the builders take these and never read the Namespace. The user-facing checks of
the data itself (files, splits, blend weights: one line naming the flag) stay in `datasets.py`,
where the files are read."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class DataConfig:
    """The training data: megatron-core's GPT datasets (or mock data) and their sample counts."""
    mock: bool  # --mock-data
    data_path: tuple[str, ...]  # prefixes, or WEIGHT PREFIX pairs (a blend)
    split: str | None  # --split (None: Megatron's default)
    cache_path: str | None  # --data-cache-path
    seed: int
    seq_length: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    create_attention_mask: bool  # --create-attention-mask-in-dataloader
    mmap_bin_files: bool
    sizes: tuple[int, int, int]  # samples requested per split (train, valid, test)

    def __post_init__(self):
        if min(self.sizes) < 0 or self.seq_length < 1:
            raise ValueError(f"split sizes {self.sizes}, sequence length {self.seq_length}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataConfig:
        return cls(mock=bool(args.mock_data), data_path=tuple(args.data_path or ()),
                   split=args.split, cache_path=args.data_cache_path, seed=args.seed,
                   seq_length=args.seq_length, reset_position_ids=bool(args.reset_position_ids),
                   reset_attention_mask=bool(args.reset_attention_mask),
                   eod_mask_loss=bool(args.eod_mask_loss),
                   create_attention_mask=bool(args.create_attention_mask_in_dataloader),
                   mmap_bin_files=bool(args.mmap_bin_files), sizes=dataset_sizes(args))


def dataset_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """Samples requested per split, as Megatron computes them."""
    gbs = args.global_batch_size
    train_samples = args.train_samples
    train_iters = args.train_iters if args.train_iters is not None else train_samples // gbs
    train = train_samples if train_samples else train_iters * gbs
    valid = (train_iters // args.eval_interval + 1) * args.eval_iters * gbs
    test = args.eval_iters * gbs
    return train, valid, test
