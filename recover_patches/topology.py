"""Rank layout of a TP x PP x DP job and the rank sets of every process group.

Megatron's default order (tp fastest, then dp, then pp): rank = tp + TP*dp + TP*DP*pp; with
`dp_last` (Megatron's --use-tp-pp-dp-mapping) tp, then pp, then dp: rank = tp + TP*pp + TP*PP*dp,
so a replica's ranks are contiguous (a node then tends to hold whole replicas).
A *replica* is one complete model copy: the TP*PP ranks sharing a dp index (DESIGN §3).
Pure arithmetic, no torch: every rank computes the same answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


class Coord(NamedTuple):
    tp: int
    replica: int  # the dp index
    pp: int


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    dp: int
    dp_last: bool = False  # --use-tp-pp-dp-mapping

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, dp_last: bool = False) -> "Topology":
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by TP*PP = {tp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), dp_last=dp_last)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp: int, replica: int, pp: int) -> int:
        if self.dp_last:
            return tp + self.tp * pp + self.tp * self.pp * replica
        return tp + self.tp * replica + self.tp * self.dp * pp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        if self.dp_last:
            return Coord(tp=rank % self.tp, replica=rank // (self.tp * self.pp),
                         pp=(rank // self.tp) % self.pp)
        return Coord(tp=rank % self.tp, replica=(rank // self.tp) % self.dp,
                     pp=rank // (self.tp * self.dp))

    def replica_ranks(self, replica: int) -> list[int]:
        return [self.rank(t, replica, p) for p in range(self.pp) for t in range(self.tp)]

    def replica_of(self, rank: int) -> int:
        return self.coord(rank).replica

    def tp_ranks(self, replica: int, pp: int) -> list[int]:
        return [self.rank(t, replica, pp) for t in range(self.tp)]

    def pp_ranks(self, tp: int, replica: int) -> list[int]:
        return [self.rank(tp, replica, p) for p in range(self.pp)]

    def embedding_ranks(self, tp: int, replica: int) -> list[int]:
        """First and last stage: they hold the two copies of tied word embeddings."""
        stages = [0] if self.pp == 1 else [0, self.pp - 1]
        return [self.rank(tp, replica, p) for p in stages]

    def dp_ranks(self, tp: int, pp: int, replicas: Sequence[int] | None = None) -> list[int]:
        """One rank per (live) replica: the group the gradient reduction runs on."""
        live = range(self.dp) if replicas is None else sorted(replicas)
        return [self.rank(tp, r, pp) for r in live]
