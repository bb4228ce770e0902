"""The interleaved schedule's order against a brute-force run of all ranks: every list length
from 0 to 3*PP (+1), several PP, virtual stages and group sizes. The checker is independent of
the order's own construction: it runs each rank's list with blocking receives and non-blocking
sends over FIFO channels, as the executor does, and lists every problem it sees."""
from __future__ import annotations

from collections import deque

import pytest
import torch

from recover_patches.pipeline.interleaved import (Action, Kind, backward_sequence, best_group,
                                         forward_sequence, makespan,
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


@pytest.mark.parametrize("stages, chunks", [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_the_group_the_executor_picks_is_valid_and_keeps_megatrons_lengths(stages, chunks):
    for n in range(0, 3 * stages + 2):
        group = best_group(n, stages, chunks, stages)
        assert stages <= group <= 2 * stages
        if n % stages == 0:
            assert group == stages, n  # Megatron's lengths keep Megatron's order
        assert problems(interleaved_orders(n, stages, chunks, group), n, stages, chunks) == [], n


def test_a_short_last_group_gets_a_larger_group_that_finishes_sooner():
    # P = 4, V = 2, nine microbatches: groups of 4 leave a group of 1 and finish after 12.3
    # microbatch times (1F1B: 12); groups of 5 after 10.5 = 9 + (P - 1) / V
    assert makespan(9, 4, 2, 4) / 6 > 9 + 3
    assert best_group(9, 4, 2, 4) == 5 and makespan(9, 4, 2, 5) / 6 == 9 + 1.5


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


# -- run_interleaved over an in-process link: every rank a thread ---------------------------------
class QueueLink:
    """FIFO channels between ranks (non-blocking sends, blocking receives), as the order assumes."""

    def __init__(self, rank: int, stages: int, chunks: int, channels: dict):
        self.rank, self.stages, self.last, self.channels = rank, stages, stages * chunks - 1, channels

    def _peer(self, kind: Kind, chunk: int, towards_input: bool) -> int | None:
        v = chunk * self.stages + self.rank
        step = -1 if (kind is Kind.FORWARD) == towards_input else 1
        peer = v + step
        return peer if 0 <= peer <= self.last else None

    def post(self, kind, chunk, index):
        pass  # a queue's receive needs no posting

    def recv(self, kind, chunk, index):
        source = self._peer(kind, chunk, towards_input=True)
        if source is None:
            return None
        got_index, tensor = self.channels[(source % self.stages, self.rank, kind)].get(timeout=30)
        assert got_index == index
        return tensor

    def send(self, kind, chunk, index, tensor):
        target = self._peer(kind, chunk, towards_input=False)
        if target is not None:
            self.channels[(self.rank, target % self.stages, kind)].put((index, tensor.detach()))

    def flush(self):
        pass

    def discard(self):
        pass


class ToyStage:
    """Virtual stage v: y = tanh(x * w_v); stage 0 starts from the id, the last returns a sum."""

    def __init__(self, v: int, last: int):
        self.v, self.last = v, last
        self.w = torch.nn.Parameter(torch.tensor([1.0 + 0.1 * v, 0.5 - 0.05 * v]))

    def forward(self, g, x):
        x = torch.full((2,), float(g)) * 0.1 if x is None else x.requires_grad_()
        y = torch.tanh(x * self.w)
        return y.sum() if self.v == self.last else y

    def backward(self, g, x, y, dy):
        torch.autograd.backward(y, grad_tensors=dy)
        return None if self.v == 0 else x.grad

    def tokens(self, g):
        return 1

    def measured(self, g):
        return None


def reference(ids, last: int) -> tuple[list[torch.Tensor], float]:
    """The gradients and the loss sum of every id through all virtual stages in one process."""
    toys, loss = [ToyStage(v, last) for v in range(last + 1)], 0.0
    for g in ids:
        x = None
        for toy in toys:
            x = toy.forward(g, x)
        x.backward()
        loss += x.item()
    return [t.w.grad for t in toys], loss


@pytest.mark.parametrize("stages, chunks, n", [(2, 2, 3), (4, 2, 5), (4, 3, 5), (3, 2, 0), (2, 3, 1)])
def test_run_interleaved_over_a_link_gives_the_sequential_gradients(stages, chunks, n):
    import queue
    import threading

    from recover_patches.pipeline.schedule import run_interleaved

    ids = [10 + 3 * i for i in range(n)]
    last = stages * chunks - 1
    channels = {(a, b, k): queue.Queue() for a in range(stages) for b in range(stages) for k in Kind}
    toys = {v: ToyStage(v, last) for v in range(last + 1)}
    results, errors = {}, []

    def rank_main(rank: int) -> None:
        try:
            mine = [toys[c * stages + rank] for c in range(chunks)]
            results[rank] = run_interleaved(ids, mine, QueueLink(rank, stages, chunks, channels),
                                            rank=rank, stages=stages, group=stages)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(not t.is_alive() for t in threads), errors
    grads, loss = reference(ids, last)
    for v, want in enumerate(grads):
        got = toys[v].w.grad
        assert (got is None and n == 0) or torch.allclose(got, want), (v, got, want)
    assert all(sorted(results[r].ids) == sorted(ids) for r in range(stages))
    assert float(results[last % stages].loss_sum) == pytest.approx(loss)


class FailingLink:
    """The link of a rank whose neighbour dies: its third receive fails."""

    def __init__(self):
        self.receives, self.sent, self.discarded, self.flushed = 0, [], False, False

    def post(self, kind, chunk, index):
        pass

    def recv(self, kind, chunk, index):
        self.receives += 1
        if self.receives == 3:
            raise ConnectionError("peer died")
        return None if kind is Kind.BACKWARD else torch.ones(2)

    def send(self, kind, chunk, index, tensor):
        self.sent.append((kind, chunk, index))

    def flush(self):
        self.flushed = True

    def discard(self):
        self.discarded = True


def test_a_failed_schedule_discards_its_posted_sends():
    """A rank that survives a failure in its schedule runs the next one on a rebuilt group: it
    must not wait there for sends posted into the broken one (negative control: without
    discarding, the link would still hold them)."""
    from recover_patches.pipeline.schedule import run_interleaved
    link = FailingLink()
    with pytest.raises(ConnectionError):
        run_interleaved([1, 2, 3, 4], [ToyStage(1, 3), ToyStage(3, 3)], link, rank=1, stages=2,
                        group=2)
    assert link.sent and link.discarded and not link.flushed
