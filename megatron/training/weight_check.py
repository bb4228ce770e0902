"""--check-weight-hash-across-dp-replicas-interval: the fingerprint each replica's ranks send in
the reduction's tail, and the error when replicas that applied the same gradients disagree."""
from __future__ import annotations

import hashlib

import torch


class WeightMismatch(RuntimeError):
    """Replicas that applied the same gradients hold different weights: never a failure, a bug."""


def weight_fingerprint(params: list[torch.Tensor]) -> int:
    """64 bits of blake2b over the weights' exact bytes (host copies, as Megatron's own check
    hashes them: an interval check, not a per-iteration cost). Never 0, which means "not sent"."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        digest.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") | 1
