"""Microbatches addressed by global id (design.md §8).

Microbatch g covers samples [g*mbs, (g+1)*mbs) of the (already shuffled) dataset, whichever replica
runs it. Stock Megatron's sampler instead binds samples to DP ranks, which is what prevents moving
work between replicas.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
MASK_KEY = "attention_mask"  # [1, seq, seq], True = masked out; only with --reset-attention-mask


class MicrobatchSampler:
    def __init__(self, dataset: Sequence[Mapping], micro_batch_size: int, with_mask: bool = False):
        if micro_batch_size < 1:
            raise ValueError("micro batch size must be >= 1")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.keys = BATCH_KEYS + ((MASK_KEY,) if with_mask else ())

    def sample_range(self, microbatch_id: int) -> range:
        start = microbatch_id * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def __call__(self, microbatch_id: int) -> dict[str, torch.Tensor]:
        indices = self.sample_range(microbatch_id)
        if indices.stop > len(self.dataset):
            raise IndexError(f"microbatch {microbatch_id} needs sample {indices.stop - 1}, "
                             f"the dataset has {len(self.dataset)}")
        samples = [self.dataset[i] for i in indices]
        return {key: torch.stack([_as_tensor(s[key]) for s in samples]) for key in self.keys}


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.asarray(value))


def first_microbatch_id(consumed_samples: int, micro_batch_size: int) -> int:
    """Global id of the next microbatch: iterations consume whole microbatches, in order, so the id
    follows from the samples consumed so far (also under batch-size ramp-up)."""
    if consumed_samples % micro_batch_size:
        raise ValueError(f"consumed samples {consumed_samples} not a multiple of {micro_batch_size}")
    return consumed_samples // micro_batch_size
