"""The commit bookkeeping reduced with the gradients (design.md §4 steps 3-4): the number of
microbatches, the token count, two checksums of the microbatch ids and the loss sum, and the check
that exactly the planned ids were reduced. The reduction itself is `grad_buffer.GradBuffer.reduce`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

_HASH_MULT = 0x9E3779B1  # odd constant: id -> pseudo-random 31-bit value


def id_hash(microbatch_id: int) -> int:
    return (microbatch_id * _HASH_MULT) % (1 << 31)


@dataclass(frozen=True)
class Totals:
    microbatches: int
    tokens: int
    id_sum: int
    id_hash_sum: int
    # only stages holding the loss contribute (last stage); a device tensor while accumulating on
    # a GPU (read on the host once, after the reduction), a float after it
    loss_sum: float | torch.Tensor
    # what the stage's meter measured, summed over the microbatches (MoE's auxiliary
    # losses per layer; `model/moe_metrics.py`); None without a meter
    measures: torch.Tensor | None = None

    @classmethod
    def of_ids(cls, ids: Iterable[int], tokens: int = 0, loss_sum: float | torch.Tensor = 0.0,
               measures: torch.Tensor | None = None) -> "Totals":
        ids = list(ids)
        return cls(len(ids), tokens, sum(ids), sum(id_hash(g) for g in ids), loss_sum, measures)

    def as_tensor(self) -> torch.Tensor:
        # float64 is exact for integers below 2**53: ids < 2**31 times M < 2**22 fits.
        return torch.tensor([self.microbatches, self.tokens, self.id_sum, self.id_hash_sum,
                             float(self.loss_sum)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Totals":
        v = t.tolist()
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), float(v[4]))

    def __add__(self, other: "Totals") -> "Totals":
        measures = other.measures if self.measures is None else \
            self.measures if other.measures is None else self.measures + other.measures
        return Totals(self.microbatches + other.microbatches, self.tokens + other.tokens,
                      self.id_sum + other.id_sum, self.id_hash_sum + other.id_hash_sum,
                      self.loss_sum + other.loss_sum, measures)


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
