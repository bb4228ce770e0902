"""A model of how NCCL runs point-to-point operations, to check a pipeline's p2p design on CPU.

gloo matches messages by tag and progresses every operation on threads of its own, so a CPU run
cannot show what NCCL would do with the same calls. The rules modelled (NCCL's, as torch's
ProcessGroupNCCL drives it):
  * a rank runs the operations it posts on one communicator in the order it posted them, one
    after another (one stream); operations posted as one group (ncclGroupStart/End) run together;
  * an operation starts only after the compute its rank had enqueued before posting it (torch
    makes the communicator's stream wait for the current stream);
  * a send and a receive run together and end together: the k-th send from s to d on a
    communicator meets the k-th receive at d from s on it. Tags are ignored;
  * compute waits for the operations the host waited on (`work.wait()`);
  * with `single_queue` (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron's recipes set it): every
    stream of a rank feeds one hardware queue, so an operation starts only after everything the
    rank posted before it, on any communicator, has ended (groups still run together).
`check` reports a deadlock (operations left that can never run) and every swapped tensor (a
receive met a send of another tensor).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Op:
    send: bool
    comm: Hashable
    peer: int
    payload: Hashable  # a send's tensor; what a receive's reader expects
    group: int | None = None  # operations with the same group id (on one rank) run together


@dataclass
class Program:
    """One rank's host order: `post(op)` returns the op's handle; `compute(waits)` enqueues a
    compute step that waits for the handles' operations."""
    ops: list[tuple[Op, int]] = field(default_factory=list)  # (op, compute steps before it)
    computes: list[list[int]] = field(default_factory=list)  # each step's waited handles

    def post(self, op: Op) -> int:
        self.ops.append((op, len(self.computes)))
        return len(self.ops) - 1

    def compute(self, waits: Sequence[int] = ()) -> None:
        self.computes.append(list(waits))


@dataclass
class _Rank:
    program: Program
    done_ops: set[int] = field(default_factory=set)
    computed: int = 0
    streams: dict[Hashable, list[int]] = field(default_factory=lambda: defaultdict(list))
    number: dict[int, int] = field(default_factory=dict)  # op -> k (k-th to that peer on comm)


def _prepare(programs: Sequence[Program], single_queue: bool) -> list[_Rank]:
    ranks = [_Rank(p) for p in programs]
    for rank in ranks:
        counts: dict[tuple, int] = defaultdict(int)
        for handle, (op, _) in enumerate(rank.program.ops):
            rank.streams[None if single_queue else op.comm].append(handle)
            key = (op.send, op.comm, op.peer)
            rank.number[handle] = counts[key]
            counts[key] += 1
    return ranks


def _running(rank: _Rank, handle: int) -> bool:
    """At the head of its stream (everything before it, outside its group, ended) and its
    compute prefix done."""
    op, prefix = rank.program.ops[handle]
    if handle in rank.done_ops or rank.computed < prefix:
        return False
    stream = rank.streams[op.comm] if op.comm in rank.streams else rank.streams[None]
    for earlier in stream:
        if earlier == handle:
            return True
        other = rank.program.ops[earlier][0]
        if earlier not in rank.done_ops and (op.group is None or other.group != op.group):
            return False
    return False


def _partner(ranks: list[_Rank], me: int, handle: int) -> int | None:
    op = ranks[me].program.ops[handle][0]
    if not 0 <= op.peer < len(ranks):
        return None
    peer = ranks[op.peer]
    for other, (candidate, _) in enumerate(peer.program.ops):
        if candidate.send != op.send and candidate.comm == op.comm and candidate.peer == me \
                and peer.number[other] == ranks[me].number[handle]:
            return other
    return None


def check(programs: Sequence[Program], single_queue: bool = False) -> list[str]:
    """Run every rank's program under the rules; the problems found (empty: none)."""
    ranks, found = _prepare(programs, single_queue), []
    progress = True
    while progress:
        progress = False
        for me, rank in enumerate(ranks):
            while rank.computed < len(rank.program.computes) and all(
                    h in rank.done_ops for h in rank.program.computes[rank.computed]):
                rank.computed += 1
                progress = True
            for handle, (op, _) in enumerate(rank.program.ops):
                if not op.send or not _running(rank, handle):
                    continue
                other = _partner(ranks, me, handle)
                if other is None or not _running(ranks[op.peer], other):
                    continue
                expected = ranks[op.peer].program.ops[other][0].payload
                if expected != op.payload:
                    found.append(f"swapped: rank {op.peer} expected {expected} on {op.comm} and "
                                 f"got {op.payload} from rank {me}")
                rank.done_ops.add(handle)
                ranks[op.peer].done_ops.add(other)
                progress = True
    stuck = {me: [rank.program.ops[h][0] for h in range(len(rank.program.ops))
                  if h not in rank.done_ops][:2]
             for me, rank in enumerate(ranks)
             if rank.computed < len(rank.program.computes) or
             len(rank.done_ops) < len(rank.program.ops)}
    if stuck:
        found.append(f"deadlock: {stuck}")
    return found
