"""The interleaved schedule's order against a brute-force run of all ranks: every list length
from 0 to 3*PP (+1), several PP, virtual stages and group sizes. The checker is independent of
the order's own construction: it runs each rank's list with blocking receives and non-blocking
sends over FIFO channels, as the executor does, and lists every problem it sees."""
from __future__ import annotations

from collections import deque

import pytest

from recover_patches.interleaved import (Action, Kind, backward_sequence, forward_sequence,
                                         interleaved_orders, warmup)


def problems(orders, n: int, stages: int, chunks: int) -> list[str]:
    last = stages * chunks - 1
    found: list[str] = []
    for rank, order in enumerate(orders):  # each forward and backward exactly once
        want = {(kind, c, k) for kind in Kind for c in range(chunks) for k in range(n)}
        got = [(a.kind, a.chunk, a.index) for a in order]
        if sorted(got, key=str) != sorted(want, key=str):
            found.append(f"rank {rank} does not run every action exactly once")
    channels: dict[tuple[int, int, Kind], deque] = {}
    done_forward: set[tuple[int, int]] = set()
    position = [0] * stages
    moved = True
    while moved:
        moved = False
        for rank in range(stages):
            while position[rank] < len(orders[rank]):
                a: Action = orders[rank][position[rank]]
                v = a.chunk * stages + rank
                source = v - 1 if a.kind is Kind.FORWARD else v + 1
                if 0 <= source <= last:  # this action's input comes over a channel
                    queue = channels.setdefault((source % stages, rank, a.kind), deque())
                    if not queue:
                        break  # a blocking receive: wait for the sender
                    message = queue.popleft()
                    if message != (source, a.index):
                        found.append(f"rank {rank} {a} read {message}, not ({source}, {a.index})")
                if a.kind is Kind.BACKWARD and (v, a.index) not in done_forward:
                    found.append(f"rank {rank} {a} before its forward")
                done_forward.add((v, a.index)) if a.kind is Kind.FORWARD else None
                target = v + 1 if a.kind is Kind.FORWARD else v - 1
                if 0 <= target <= last:  # a non-blocking send
                    channels.setdefault((rank, target % stages, a.kind), deque()).append((v, a.index))
                position[rank] += 1
                moved = True
    stuck = [(r, orders[r][position[r]]) for r in range(stages) if position[r] < len(orders[r])]
    if stuck:
        found.append(f"deadlock: {stuck}")
    return found


SHAPES = [(p, v, g) for p in (1, 2, 3, 4) for v in (1, 2, 3) for g in {p, p + 1}]


@pytest.mark.parametrize("stages, chunks, group", SHAPES)
def test_every_length_runs_to_the_end_in_dependency_order(stages, chunks, group):
    for n in range(0, 3 * stages + 2):
        orders = interleaved_orders(n, stages, chunks, group)
        assert problems(orders, n, stages, chunks) == [], (n, stages, chunks, group)


def megatron_order(n: int, stages: int, rank: int, chunks: int, group: int) -> list[Action]:
    """Megatron's fixed warm-up, then one forward and one backward, then the cool-down."""
    fwd, bwd = forward_sequence(n, chunks, group), backward_sequence(n, chunks, group)
    w = warmup(stages, rank, chunks, group, n)
    order = [Action(Kind.FORWARD, c, k) for c, k in fwd[:w]]
    for i in range(w, len(fwd)):
        order += [Action(Kind.FORWARD, *fwd[i]), Action(Kind.BACKWARD, *bwd[i - w])]
    return order + [Action(Kind.BACKWARD, c, k) for c, k in bwd[len(fwd) - w:]]


@pytest.mark.parametrize("stages, chunks", [(2, 2), (4, 2), (4, 3), (3, 2)])
def test_lengths_megatron_accepts_get_megatrons_order(stages, chunks):
    for n in range(stages, 4 * stages + 1, stages):
        ours = interleaved_orders(n, stages, chunks, stages)
        assert [list(o) for o in ours] == [megatron_order(n, stages, r, chunks, stages)
                                           for r in range(stages)], n


def test_megatrons_fixed_warmup_deadlocks_on_a_short_last_group():
    """Why the order is simulated: the checker catches what a fixed warm-up gets wrong."""
    fixed = [megatron_order(5, 4, r, 3, 4) for r in range(4)]
    assert any("deadlock" in p for p in problems(fixed, 5, 4, 3))
    assert problems(interleaved_orders(5, 4, 3, 4), 5, 4, 3) == []


def test_a_bad_shape_is_refused():
    with pytest.raises(ValueError):
        interleaved_orders(3, 2, 0, 2)
