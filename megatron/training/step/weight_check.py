"""--check-weight-hash-across-dp-replicas-interval: the fingerprint each replica's ranks send in
the reduction's tail, and the error when replicas that applied the same gradients disagree."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


class WeightMismatch(RuntimeError):
    """Replicas that applied the same gradients hold different weights: never a failure, a bug."""


def check_due(interval: int, done: int) -> bool:
    """--check-weight-hash-across-dp-replicas-interval N: the weights after iteration `done` (a
    multiple of N) are compared in the next iteration's reduction."""
    return bool(interval) and done > 0 and done % interval == 0


def weight_fingerprint(params: list[torch.Tensor]) -> int:
    """64 bits of blake2b over the weights' exact bytes (host copies, as Megatron's own check
    hashes them: an interval check, not a per-iteration cost). Never 0, which means "not sent"."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        digest.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") | 1


def corrupt_a_weight(optimizer) -> None:
    """Fault injection (`corrupt`): one weight of this rank changes, as a bit flip would."""
    with torch.no_grad():
        model, main = optimizer.model_params[0], optimizer.main_params[0]
        for weight in [model] if main is model else [model, main]:
            weight.view(-1)[0] += 1.0


def agreed_mismatch(hashes: dict[int, int], ep: int, replica_group, device, iteration: int
                    ) -> None:
    """WeightMismatch on every rank of the replica if any of its DP groups saw two fingerprints
    among the replicas holding the same experts (`hashes`: by live replica)."""
    mismatch = torch.tensor([int(any(len({h for r, h in hashes.items() if r % ep == e}) > 1
                                     for e in range(ep)))], device=device)
    if replica_group.size() > 1:
        dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=replica_group)
    if mismatch.item():
        raise WeightMismatch(
            f"after iteration {iteration} the data-parallel replicas hold different weights "
            "(fingerprints by replica: " + ", ".join(f"{r}: {h:016x}" for r, h in hashes.items())
            + " on this rank's shard): a bug or silent data corruption; stopping")
