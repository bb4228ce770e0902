"""Rank layout of a TP x CP x PP x DP job and the rank sets of every process group.

Megatron's default order (`tp-cp-ep-dp-pp`: tp fastest, then cp, then dp, then pp):
rank = tp + TP*cp + TP*CP*dp + TP*CP*DP*pp; with `dp_last` (Megatron's --use-tp-pp-dp-mapping,
`tp-cp-ep-pp-dp`) pp before dp: rank = tp + TP*cp + TP*CP*pp + TP*CP*PP*dp, so a replica's ranks
are contiguous (a node then tends to hold whole replicas). A *replica* is one complete model
copy but for its experts: the TP*CP*PP ranks sharing a dp index (design.md §3); its CP ranks
hold the same weights and split each sequence, as its TP ranks split each layer. Expert
parallelism (Megatron's `ep` inside `dp`) splits the experts over EP consecutive replicas, a
*unit*: replica r is expert rank r % EP of unit r // EP, and a unit fails as one (design.md §3).
Megatron-FSDP's shard groups are units alike: F consecutive replicas hold one model's parameters
between them (design.md §19).
Pure arithmetic, no torch: every rank computes the same answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence


class Coord(NamedTuple):
    tp: int
    replica: int  # the dp index
    pp: int
    cp: int = 0  # the context-parallel index inside the replica


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    dp: int
    dp_last: bool = False  # --use-tp-pp-dp-mapping
    cp: int = 1  # --context-parallel-size
    ep: int = 1  # --expert-model-parallel-size: replicas per unit
    fsdp: int = 1  # --use-megatron-fsdp: replicas per shard group (DP / shard groups)

    def __post_init__(self):
        if self.ep > 1 and self.fsdp > 1:
            raise ValueError("a unit is either expert-parallel or a Megatron-FSDP shard group")

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, dp_last: bool = False,
                   cp: int = 1, ep: int = 1, shard_groups: int | None = None) -> "Topology":
        """`shard_groups` U (Megatron-FSDP): the DP replicas form U shard groups."""
        if world_size % (tp * pp * cp):
            raise ValueError(f"world size {world_size} is not divisible by TP*CP*PP = "
                             f"{tp * cp * pp}")
        dp = world_size // (tp * pp * cp)
        if dp % ep:
            raise ValueError(f"data-parallel size {dp} is not divisible by EP = {ep}")
        if shard_groups is not None and dp % shard_groups:
            raise ValueError(f"data-parallel size {dp} is not divisible by "
                             f"--num-distributed-optimizer-instances {shard_groups}")
        fsdp = 1 if shard_groups is None else dp // shard_groups
        return cls(tp=tp, pp=pp, dp=dp, dp_last=dp_last, cp=cp, ep=ep, fsdp=fsdp)

    @property
    def unit_size(self) -> int:
        """Replicas per unit: those whose one death breaks them all (EP's, or a shard group's)."""
        return self.ep * self.fsdp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def rank(self, tp: int, replica: int, pp: int, cp: int = 0) -> int:
        inner, width = tp + self.tp * cp, self.tp * self.cp  # tp fastest, then cp
        if self.dp_last:
            return inner + width * pp + width * self.pp * replica
        return inner + width * replica + width * self.dp * pp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp, cp, outer = rank % self.tp, (rank // self.tp) % self.cp, rank // (self.tp * self.cp)
        if self.dp_last:
            return Coord(tp=tp, replica=outer // self.pp, pp=outer % self.pp, cp=cp)
        return Coord(tp=tp, replica=outer % self.dp, pp=outer // self.dp, cp=cp)

    def replica_ranks(self, replica: int) -> list[int]:
        return [self.rank(t, replica, p, c) for p in range(self.pp) for c in range(self.cp)
                for t in range(self.tp)]

    def unit_replicas(self, replica: int) -> list[int]:
        """The replicas that hold the experts or the parameters together with this one (itself
        alone at EP 1 without Megatron-FSDP)."""
        first = replica // self.unit_size * self.unit_size
        return list(range(first, first + self.unit_size))

    def unit_ranks(self, replica: int) -> list[int]:
        """Every rank of this replica's unit: a death of any of them breaks all its replicas."""
        return [rank for r in self.unit_replicas(replica) for rank in self.replica_ranks(r)]

    def ep_ranks(self, tp: int, replica: int, pp: int) -> list[int]:
        """The unit's ranks at this (tp, pp): megatron-core's expert-parallel group."""
        return [self.rank(tp, r, pp) for r in self.unit_replicas(replica)]

    def tp_ep_ranks(self, replica: int, pp: int) -> list[int]:
        """The unit's ranks at this stage (the allgather dispatcher's group), tp fastest."""
        return [self.rank(t, r, pp) for r in self.unit_replicas(replica) for t in range(self.tp)]

    def expert_dp_ranks(self, tp: int, replica: int, pp: int,
                        replicas: Sequence[int] | None = None) -> list[int]:
        """The (live) replicas' ranks holding the same experts as this one, at this (tp, pp):
        where expert gradients are summed (Megatron's expert-data-parallel group)."""
        live = range(self.dp) if replicas is None else sorted(replicas)
        return [self.rank(tp, r, pp) for r in live if r % self.ep == replica % self.ep]

    def replica_of(self, rank: int) -> int:
        return self.coord(rank).replica

    def tp_ranks(self, replica: int, pp: int, cp: int = 0) -> list[int]:
        return [self.rank(t, replica, pp, cp) for t in range(self.tp)]

    def cp_ranks(self, tp: int, replica: int, pp: int) -> list[int]:
        """The ranks that split this replica's sequences at this (tp, pp) place."""
        return [self.rank(tp, replica, pp, c) for c in range(self.cp)]

    def pp_ranks(self, tp: int, replica: int, cp: int = 0) -> list[int]:
        return [self.rank(tp, replica, p, cp) for p in range(self.pp)]

    def embedding_ranks(self, tp: int, replica: int, cp: int = 0) -> list[int]:
        """First and last stage: they hold the two copies of tied word embeddings."""
        stages = [0] if self.pp == 1 else [0, self.pp - 1]
        return [self.rank(tp, replica, p, cp) for p in stages]

    def dp_ranks(self, tp: int, pp: int, replicas: Sequence[int] | None = None,
                 cp: int = 0) -> list[int]:
        """One rank per (live) replica."""
        live = range(self.dp) if replicas is None else sorted(replicas)
        return [self.rank(tp, r, pp, cp) for r in live]

    def dp_cp_ranks(self, tp: int, pp: int, replicas: Sequence[int] | None = None) -> list[int]:
        """Every CP rank of every (live) replica at this (tp, pp): the group the gradient
        reduction runs on (Megatron's data-parallel group with context parallelism)."""
        live = range(self.dp) if replicas is None else sorted(replicas)
        return sorted(self.rank(tp, r, pp, c) for r in live for c in range(self.cp))
