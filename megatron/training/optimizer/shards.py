"""Where the distributed optimizer's state lives, and what moves when the live replicas change.

The DP replicas form K instances of S consecutive replicas (replica r is in instance r // S). The
live replicas of an instance split each bucket of the flat parameter space into equal chunks, in
replica order: the j-th of n live replicas holds [s + j * ceil(L / n), s + (j + 1) * ceil(L / n))
of a bucket [s, s + L), clipped to it. Every
instance with a live replica thus holds a whole copy, which is what lets survivors fetch the
shards of a dead replica from another instance. All functions here are pure: every rank computes
the same answer from the same agreed inputs.

With expert parallelism the experts' buckets are sharded apart: among the replicas of an
instance that hold the same experts (one per unit; Megatron's intra-instance expert-data-parallel
group), each holding their range of every expert bucket. So the instance still holds one whole
copy of everything, and the holders of an expert bucket are the units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Transfer:
    """Elements [lo, hi) of the flat space go from group rank `src` to group rank `dst`."""
    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Sharding:
    """One kind of bucket (the dense weights', or the experts') while every replica is live: this
    rank is `shard` of `shards` in `instance` (the process group its ranges gather over)."""
    shard: int
    shards: int
    instance: Any


@dataclass(frozen=True)
class ShardDomain:
    """Who holds one kind of bucket now: the live `holders` in order (instances of `per_instance`
    consecutive ones), and `group`, whose ranks are the holders in that order (pieces move over
    it point to point)."""
    holders: tuple[int, ...]
    per_instance: int
    group: Any


class ShardLost(Exception):
    """No live rank holds [lo, hi): the optimizer state there died with its replicas."""

    def __init__(self, lo: int, hi: int):
        super().__init__(f"[{lo}, {hi})")
        self.lo, self.hi = lo, hi


def shard_range(numel: int, shard: int, shards: int) -> tuple[int, int]:
    chunk = math.ceil(numel / shards)
    return min(shard * chunk, numel), min((shard + 1) * chunk, numel)


def bucket_ranges(buckets: Sequence[tuple[int, int]], shard: int,
                  shards: int) -> list[tuple[int, int]]:
    """The shard's range in each bucket: every bucket is split in `shards` equal chunks (the
    last one shorter unless the bucket is padded to a multiple), so a bucket's weights are
    all-gathered, and its gradients reduce-scattered, as one operation."""
    return [(s + lo, s + hi) for s, e in buckets for lo, hi in [shard_range(e - s, shard, shards)]]


def instance_positions(holders: Sequence[int], per_instance: int) -> list[tuple[int, int]]:
    """(shard, shards) of each live holder (a replica, or with CP a replica's CP rank), in the
    order given: its place among its instance's live holders, and how many there are."""
    result = []
    for r in holders:
        mates = sorted(q for q in holders if q // per_instance == r // per_instance)
        result.append((mates.index(r), len(mates)))
    return result


def _missing(wanted: tuple[int, int], held: tuple[int, int]) -> list[tuple[int, int]]:
    (a, b), (c, d) = wanted, held
    if c >= d:
        return [(a, b)] if a < b else []
    return [(x, y) for x, y in ((a, min(b, c)), (max(a, d), b)) if x < y]


def plan_transfers(held: Sequence[tuple[int, int]],
                   wanted: Sequence[tuple[int, int]]) -> list[Transfer]:
    """Every piece of each rank's wanted range that it does not hold itself, from the lowest rank
    that holds it. `held[i]` and `wanted[i]` are group rank i's ranges ((x, x): nothing).
    Raises ShardLost for the first piece no rank holds."""
    transfers = []
    for dst, want in enumerate(wanted):
        for lo, hi in _missing(want, held[dst]):
            at = lo
            while at < hi:
                src = next((i for i, (c, d) in enumerate(held) if i != dst and c <= at < d), None)
                if src is None:
                    ends = [c for c, _ in held if at < c < hi]
                    raise ShardLost(at, min(ends, default=hi))
                end = min(hi, held[src][1])
                transfers.append(Transfer(src, dst, at, end))
                at = end
    return transfers
