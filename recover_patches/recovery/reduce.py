"""Out-of-place DP reduction of gradients together with the commit bookkeeping (DESIGN §4 step 3).

The local accumulated gradients are copied into a fresh buffer and only that buffer is reduced, so
an interrupted reduction never leaves a half-summed `.grad`. Reduced alongside: the number of
microbatches, the token count, two checksums of the microbatch ids and the loss sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

_HASH_MULT = 0x9E3779B1  # odd constant: id -> pseudo-random 31-bit value


def id_hash(microbatch_id: int) -> int:
    return (microbatch_id * _HASH_MULT) % (1 << 31)


@dataclass(frozen=True)
class Totals:
    microbatches: int
    tokens: int
    id_sum: int
    id_hash_sum: int
    loss_sum: float  # only stages holding the loss contribute (last stage)

    @classmethod
    def of_ids(cls, ids: Iterable[int], tokens: int = 0, loss_sum: float = 0.0) -> "Totals":
        ids = list(ids)
        return cls(len(ids), tokens, sum(ids), sum(id_hash(g) for g in ids), loss_sum)

    def as_tensor(self) -> torch.Tensor:
        # float64 is exact for integers below 2**53: ids < 2**31 times M < 2**22 fits.
        return torch.tensor([self.microbatches, self.tokens, self.id_sum, self.id_hash_sum,
                             self.loss_sum], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Totals":
        v = t.tolist()
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), float(v[4]))

    def __add__(self, other: "Totals") -> "Totals":
        return Totals(self.microbatches + other.microbatches, self.tokens + other.tokens,
                      self.id_sum + other.id_sum, self.id_hash_sum + other.id_hash_sum,
                      self.loss_sum + other.loss_sum)


class CommitError(RuntimeError):
    """The reduced iteration is not exactly the planned M microbatches: a bug, never a failure."""


def check_commit(reduced: Totals, planned_ids: Sequence[int]) -> None:
    expected = Totals.of_ids(planned_ids)
    if (reduced.microbatches, reduced.id_sum, reduced.id_hash_sum) != (
            expected.microbatches, expected.id_sum, expected.id_hash_sum):
        raise CommitError(
            f"reduced {reduced.microbatches} microbatches (id sum {reduced.id_sum}, hash "
            f"{reduced.id_hash_sum}); the plan has {expected.microbatches} (id sum "
            f"{expected.id_sum}, hash {expected.id_hash_sum})")


@dataclass
class ReducedGradients:
    flat: torch.Tensor
    totals: Totals

    def write_to(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's local gradient by its reduced one (after the commit check)."""
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = self.flat[offset:offset + n].view_as(p).clone()
            offset += n


def flatten_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
    ]) if params else torch.zeros(0)


def reduce_gradients(params: Sequence[torch.nn.Parameter], local: Totals, dp_group) -> ReducedGradients:
    flat = flatten_grads(params)  # a copy: the local .grad stays intact
    stats = local.as_tensor()
    if dp_group is not None and dp_group.size() > 1:
        dist.all_reduce(flat, group=dp_group)
        dist.all_reduce(stats, group=dp_group)
    return ReducedGradients(flat, Totals.from_tensor(stats))
