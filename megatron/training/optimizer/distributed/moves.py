"""The distributed optimizer's re-shard, on the wire: who holds which ranges now, and the point
to point moves that give each live rank its new ranges (`optimizer_shards` plans them; these
carry them out). Each range travels as flat fp32 tensors: the main params, then Adam's moments."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron.training.optimizer.shards import (ShardDomain, Transfer, bucket_ranges,
                                                instance_positions, plan_transfers)

Ranges = Sequence[tuple[int, int]]  # one [lo, hi) per bucket
# Elements per point-to-point message (64 MiB of fp32): each must finish within --recover-timeout.
CHUNK = 1 << 24


def held_ranges(ranges: Ranges, step: int, device: torch.device, dp_group, size: int
                ) -> tuple[list[list[tuple[int, int]]], int]:
    """Every group rank's ranges and the newest Adam step among them; a rank behind that step
    (a spare's old state) counts as holding nothing. A collective over `dp_group`."""
    mine = torch.tensor([x for r in ranges for x in r] + [step], dtype=torch.int64, device=device)
    every = mine
    if size > 1:
        every = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
        dist.all_gather_single(every, mine, group=dp_group)
    rows = every.view(size, mine.numel()).tolist()
    newest = max(row[-1] for row in rows)
    return [[(row[2 * b], row[2 * b + 1]) if row[-1] == newest else (0, 0)
             for b in range(len(ranges))] for row in rows], newest


def keep_own(fresh: list[torch.Tensor], mine: list[torch.Tensor], ranges: Ranges,
             bases: Sequence[int], old: Ranges, old_bases: Sequence[int]) -> None:
    """Copy what this rank already holds of its new ranges from its old ones."""
    for b, ((lo, hi), (c, d)) in enumerate(zip(ranges, old)):
        a, z = max(lo, c), min(hi, d)
        if a < z:
            for new, kept in zip(fresh, mine):
                new[bases[b] + a - lo:bases[b] + z - lo].copy_(
                    kept[old_bases[b] + a - c:old_bases[b] + z - c])


def move_pieces(plans: Sequence[Sequence[Transfer]], me: int, mine: list[torch.Tensor],
                fresh: list[torch.Tensor], ranges: Ranges, bases: Sequence[int], old: Ranges,
                old_bases: Sequence[int], dp_group) -> int:
    """Send what others take from this rank, receive what it takes (every rank walks the same
    plans in the same order, so sends and receives pair up). Returns the elements received per
    tensor."""
    received = 0
    for b, transfers in enumerate(plans):
        for t in transfers:
            if me == t.src:
                at = old_bases[b] + t.lo - old[b][0]
                for kept in mine:
                    for piece in kept[at:at + t.hi - t.lo].split(CHUNK):
                        dist.send(piece, group=dp_group, group_dst=t.dst)
            elif me == t.dst:
                at = bases[b] + t.lo - ranges[b][0]
                for new in fresh:
                    for piece in new[at:at + t.hi - t.lo].split(CHUNK):
                        dist.recv(piece, group=dp_group, group_src=t.src)
                received += t.hi - t.lo
    return received


def plan_domain(domain: ShardDomain, buckets: Ranges, mine: Sequence[int], held_now: Ranges,
                step: int, device: torch.device, ranges: list[tuple[int, int]], shards: list[int]
                ) -> tuple[list[list[Transfer]], int, bool]:
    """The re-shard of one kind of bucket (`mine`: the dense ones, or the experts') over its
    `domain`: this rank's new ranges and shard counts written into `ranges` and `shards`; returns
    the transfers per bucket (none for the other kind), the newest Adam step among the domain's
    ranks and whether this rank's state (`held_now`, at `step`) is valid. A collective over the
    domain's group; ShardLost if some piece died with every rank that held it."""
    group, live = domain.group, sorted(domain.holders)
    me, size = (0, 1) if group is None else (group.rank(), group.size())
    positions = instance_positions(live, domain.per_instance)
    wanted = [bucket_ranges(buckets, j, n) for j, n in positions]
    held, newest = held_ranges(held_now, step, device, group, size)
    plans: list[list[Transfer]] = [[] for _ in buckets]
    for b in mine:
        plans[b] = plan_transfers([h[b] for h in held], [w[b] for w in wanted])
    for b in mine:
        ranges[b], shards[b] = wanted[me][b], positions[me][1]
    return plans, newest, any(held[me][b][0] < held[me][b][1] for b in mine)


def local_bases(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Where each bucket's range starts in a rank's local (concatenated) tensors."""
    bases, at = [], 0
    for lo, hi in ranges:
        bases.append(at)
        at += hi - lo
    return bases
