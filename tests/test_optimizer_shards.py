"""Who holds which slice of the distributed optimizer's state, and what moves when replicas change:
checked against a brute-force walk over every element."""
from __future__ import annotations

import random

import pytest

from megatron.training.optimizer.shards import (ShardLost, instance_positions, plan_transfers,
                                                shard_range)


def test_positions_follow_the_live_replicas_of_each_instance():
    assert instance_positions([0, 1, 2, 3], 2) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert instance_positions([0, 2, 3], 2) == [(0, 1), (0, 2), (1, 2)]  # replica 1 died
    assert instance_positions([1, 3], 4) == [(0, 2), (1, 2)]  # K = 1 (one instance)


def test_shard_ranges_tile_the_flat_space():
    for numel in (1, 7, 64, 1001):
        for shards in (1, 2, 3, 5):
            ranges = [shard_range(numel, j, shards) for j in range(shards)]
            covered = [x for lo, hi in ranges for x in range(lo, hi)]
            assert covered == list(range(numel)), (numel, shards)


def _problems(held, wanted, transfers) -> list[str]:
    """Brute force: after the transfers every rank has every element it wants, each from a rank
    that held it, never one it already held itself, and nothing arrives twice."""
    problems = []
    for dst, (lo, hi) in enumerate(wanted):
        got = {x for x in range(lo, hi) if held[dst][0] <= x < held[dst][1]}
        for t in transfers:
            if t.dst != dst:
                continue
            if t.src == dst or not held[t.src][0] <= t.lo < t.hi <= held[t.src][1]:
                problems.append(f"{t} is not from another rank's holding")
            arriving = set(range(t.lo, t.hi))
            if arriving & got:
                problems.append(f"{t} brings elements rank {dst} has")
            got |= arriving
        if got != set(range(lo, hi)):
            problems.append(f"rank {dst} ends with {sorted(got)}, wants [{lo}, {hi})")
    return problems


def test_losing_a_replica_fetches_its_slice_from_the_other_instance():
    numel = 10
    before = [shard_range(numel, j, n) for j, n in instance_positions([0, 1, 2, 3], 2)]
    live = [0, 2, 3]  # replica 1 died: its slice [5, 10) lives on in replica 3
    held = [before[r] for r in live]
    wanted = [shard_range(numel, j, n) for j, n in instance_positions(live, 2)]
    transfers = plan_transfers(held, wanted)
    assert [(t.src, t.dst, t.lo, t.hi) for t in transfers] == [(2, 0, 5, 10)]
    assert _problems(held, wanted, transfers) == []


def test_a_slice_no_live_rank_holds_is_reported():
    # both holders of [5, 10) (replicas 1 and 3) are gone
    with pytest.raises(ShardLost) as lost:
        plan_transfers([(0, 5), (0, 5)], [(0, 10), (0, 10)])
    assert (lost.value.lo, lost.value.hi) == (5, 10)


def test_random_holdings_are_completed_exactly():
    for seed in range(300):
        held, wanted = _random_holdings(random.Random(seed))
        assert _problems(held, wanted, plan_transfers(held, wanted)) == [], (seed, held, wanted)


def _random_holdings(rng: random.Random):
    numel, ranks = rng.randint(1, 40), rng.randint(1, 6)
    # a whole copy spread over some ranks (what a live instance holds), the rest arbitrary
    # (a partly finished earlier re-shard, a joiner that holds nothing)
    cuts = sorted(rng.sample(range(1, numel), min(numel - 1, rng.randint(0, ranks - 1))))
    copy = list(zip([0, *cuts], [*cuts, numel]))
    held = [(0, 0)] * ranks
    for i, r in enumerate(rng.sample(range(ranks), len(copy))):
        held[r] = copy[i]
    for r in range(ranks):
        if held[r] == (0, 0) and rng.random() < 0.5:
            a = rng.randint(0, numel)
            held[r] = (a, rng.randint(a, numel))
    wanted = []
    for _ in range(ranks):
        a = rng.randint(0, numel)
        wanted.append((a, rng.randint(a, numel)))
    return held, wanted
