"""The order of the interleaved (virtual-pipeline) 1F1B schedule over a list of any length.

Each of the P pipeline ranks holds V model chunks; chunk c of rank r is virtual stage v = c*P + r,
so an activation goes r -> r+1 within a chunk and from the last rank back to rank 0 into the next
chunk. Microbatches go in groups of G (--microbatch-group-size-per-virtual-pipeline-stage, default
P): a group runs through chunk 0 on every rank, then chunk 1, ...; its backwards run the chunks in
reverse. These two sequences (`forward_sequence`, `backward_sequence`) are Megatron's.

What is not Megatron's: Megatron requires the microbatch count to be a multiple of P, while a
ReCoVer replica must run *any* list (its quota, a lost replica's ids, fewer ids than P). Megatron
then alternates one forward and one backward after a fixed warm-up of (P - r - 1) * 2 + (V - 1) * G
forwards, which deadlocks for some lengths once the last group is short (e.g. P = 4, V = 3, five
microbatches). Here each rank's order merges the two sequences by simulating all P ranks with unit
costs (a forward 1, a backward 2). Each rank prefers what Megatron's order runs next (forwards
through the warm-up, then one forward and one backward) and waits, as Megatron's blocking receive
does, while that is not ready. Only when every rank waits -- where Megatron's order deadlocks --
does the first rank that can run its other action run it. The simulation so finishes for every
length and the orders are valid: with blocking receives in this order and non-blocking sends,
every run completes (a Kahn network one of whose executions completed), and each channel carries
its messages in the order its receiver reads them. Where Megatron's order works (its lengths), the
orders are Megatron's.

"Non-blocking sends" is the executor's obligation: gloo's isend progresses on its own threads, but
NCCL runs a rank's p2p kernels on one communicator in order on one stream, so a send there would
hold back the receives behind it; `recover_patches.pipeline.p2p.ChunkP2P` gives every channel a
communicator of its own (checked under a model of NCCL's rules: tests/test_p2p_nccl_rules.py).
`recover_patches.pipeline.schedule.run_interleaved` runs an order; `makespan` is the same simulation's
finish time, layer 3's cost model; `best_group` picks, per list length, the group size whose order
finishes first (the fallback for lengths that leave a short last group). Pure Python (no torch):
layer 3 imports it.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    kind: Kind
    chunk: int
    index: int  # position in the id list


def forward_sequence(n: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(chunk, index) in forward order: groups of `group` indices, each through every chunk."""
    return [(c, k) for start in range(0, n, group) for c in range(chunks)
            for k in range(start, min(start + group, n))]


def backward_sequence(n: int, chunks: int, group: int) -> list[tuple[int, int]]:
    return [(c, k) for start in range(0, n, group) for c in reversed(range(chunks))
            for k in range(start, min(start + group, n))]


def warmup(stages: int, rank: int, chunks: int, group: int, n: int) -> int:
    """Megatron's count of forwards before the first backward, capped at all of them."""
    return min(n * chunks, (stages - rank - 1) * 2 + (chunks - 1) * group)


FORWARD_COST, BACKWARD_COST = 1, 2


def interleaved_orders(n: int, stages: int, chunks: int, group: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's order of forwards and backwards (rank r's is element r). Pure and cached:
    every rank computes all of them and they agree without communication."""
    return _simulate(n, stages, chunks, group)[0]


@functools.lru_cache(maxsize=1024)
def best_group(n: int, stages: int, chunks: int, group: int) -> int:
    """The group size a list of `n` runs with: the one in [group, 2 * group] whose order finishes
    first (ties: the smallest, so `group` itself wherever it is best -- Megatron's lengths). A
    short last group stretches the schedule (P = 4, V = 2, nine microbatches in groups of 4
    finish after 12.3 microbatch times, later than 1F1B's 12; groups of 5 finish after 10.5, the
    n + (P - 1) / V of Megatron's lengths). The cap keeps in-flight activations within twice the
    configured group's. Full groups (n a multiple of `group`) keep it without a search: the
    search simulates up to group + 1 orders, seconds for a thousand microbatches at P = 16."""
    if chunks == 1 or n <= group or n % group == 0:
        return group
    return min(range(group, 2 * group + 1),
               key=lambda g: (_simulate(n, stages, chunks, g)[1], g))


def makespan(n: int, stages: int, chunks: int, group: int) -> int:
    """When the last rank finishes `n` microbatches, in the simulation's units (a chunk's forward
    1, its backward 2: one microbatch is 3 * chunks units of one rank's work). With one chunk it is
    1F1B's (n + stages - 1) * 3 for n > 0."""
    return _simulate(n, stages, chunks, group)[1]


@functools.lru_cache(maxsize=1024)
def _simulate(n: int, stages: int, chunks: int, group: int
              ) -> tuple[tuple[tuple[Action, ...], ...], int]:
    if n < 0 or stages < 1 or chunks < 1 or group < 1:
        raise ValueError(f"bad schedule shape n={n} stages={stages} chunks={chunks} group={group}")
    fwd, bwd = forward_sequence(n, chunks, group), backward_sequence(n, chunks, group)
    last = stages * chunks - 1
    next_f, next_b = [0] * stages, [0] * stages
    free_at = [0] * stages  # time a rank finishes what it is running
    orders: list[list[Action]] = [[] for _ in range(stages)]
    finish: dict[tuple[Kind, int, int], int] = {}  # (kind, virtual stage, index) -> time done
    time, total = 0, n * chunks

    def ready(rank: int, kind: Kind) -> bool:
        seq, i = (fwd, next_f[rank]) if kind is Kind.FORWARD else (bwd, next_b[rank])
        if i >= total:
            return False
        c, k = seq[i]
        v = c * stages + rank
        if kind is Kind.FORWARD:
            return v == 0 or finish.get((Kind.FORWARD, v - 1, k), time + 1) <= time
        own = finish.get((Kind.FORWARD, v, k), time + 1) <= time
        return own and (v == last or finish.get((Kind.BACKWARD, v + 1, k), time + 1) <= time)

    def start(rank: int, kind: Kind) -> None:
        seq, counter = (fwd, next_f) if kind is Kind.FORWARD else (bwd, next_b)
        c, k = seq[counter[rank]]
        counter[rank] += 1
        free_at[rank] = time + (FORWARD_COST if kind is Kind.FORWARD else BACKWARD_COST)
        finish[(kind, c * stages + rank, k)] = free_at[rank]
        orders[rank].append(Action(kind, c, k))

    def preferred(rank: int) -> Kind:
        """Megatron's: forwards through the warm-up and one more, then a backward per forward."""
        in_flight = next_f[rank] - next_b[rank]
        if next_f[rank] >= total or in_flight > warmup(stages, rank, chunks, group, n):
            return Kind.BACKWARD
        return Kind.FORWARD

    while any(next_b[r] < total for r in range(stages)):
        idle = [r for r in range(stages) if free_at[r] <= time and next_b[r] < total]
        started = False
        for rank in idle:
            if ready(rank, preferred(rank)):
                start(rank, preferred(rank))
                started = True
        if not started and all(free_at[r] <= time for r in range(stages)):
            # every unfinished rank waits for its preferred action: Megatron's fixed order would
            # deadlock here. The first rank that can run its other action does.
            for rank in idle:
                other = Kind.FORWARD if preferred(rank) is Kind.BACKWARD else Kind.BACKWARD
                if ready(rank, other):
                    start(rank, other)
                    break
            else:
                raise AssertionError(f"schedule simulation stalled: n={n} stages={stages} "
                                     f"chunks={chunks} group={group}")  # cannot happen
        time += 1
    return tuple(tuple(o) for o in orders), max(free_at)


