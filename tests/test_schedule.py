"""1F1B order over any number of microbatches, checked on an in-memory pipeline of threads."""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from recover_patches.pipeline.schedule import run_1f1b, run_forward_only


class QueueLink:
    """Duck-typed StageLink: one queue per direction between neighbouring stages."""

    def __init__(self, stage: int, num_stages: int, fwd: list[queue.Queue], bwd: list[queue.Queue]):
        self.stage, self.num_stages, self.fwd, self.bwd = stage, num_stages, fwd, bwd
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1

    def _get(self, q):
        return q.get(timeout=10)

    def recv_forward(self):
        return None if self.is_first else self._get(self.fwd[self.stage - 1]).requires_grad_()

    def send_forward(self, y):
        if not self.is_last:
            self.fwd[self.stage].put(y.detach().clone())

    def recv_backward(self):
        return None if self.is_last else self._get(self.bwd[self.stage])

    def send_backward(self, dx):
        if not self.is_first:
            self.bwd[self.stage - 1].put(dx.clone())

    def send_forward_recv_backward(self, y):
        self.send_forward(y)
        return self.recv_backward()

    def send_backward_recv_forward(self, dx):
        self.send_backward(dx)
        return self.recv_forward()


class ScaleStage:
    """y = w * x (first stage: x = id); records the order of calls and the activations held."""

    def __init__(self, stage: int, num_stages: int):
        self.stage, self.is_last = stage, stage == num_stages - 1
        self.w = torch.tensor(2.0, requires_grad=True)
        self.events: list[tuple[str, int]] = []
        self.live = 0
        self.peak_live = 0

    def forward(self, g, x):
        self.events.append(("F", g))
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        x = torch.tensor(float(g)) if x is None else x
        return self.w * x

    def backward(self, g, x, y, dy):
        self.live -= 1
        torch.autograd.backward(y, grad_tensors=None if self.is_last else dy)
        self.events.append(("B", g))
        return None if x is None else x.grad

    def tokens(self, g):
        return 10

    def measured(self, g):
        return None


def run_pipeline(ids, num_stages, forward_only=False):
    fwd = [queue.Queue() for _ in range(num_stages)]
    bwd = [queue.Queue() for _ in range(num_stages)]
    stages = [ScaleStage(s, num_stages) for s in range(num_stages)]
    results, errors = [None] * num_stages, []

    def work(s):
        try:
            link = QueueLink(s, num_stages, fwd, bwd)
            run = run_forward_only if forward_only else run_1f1b
            results[s] = run(ids, stages[s], link)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return stages, results


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_every_microbatch_once_in_order_with_bounded_activations(n, num_stages):
    ids = list(range(100, 100 + n))
    stages, results = run_pipeline(ids, num_stages)
    for s, (stage, result) in enumerate(zip(stages, results)):
        assert [g for kind, g in stage.events if kind == "F"] == ids
        assert [g for kind, g in stage.events if kind == "B"] == ids  # told which it is
        assert result.ids == ids and result.tokens == 10 * n
        assert stage.live == 0
        # 1F1B: stage s never holds more than (P - s) activations
        assert stage.peak_live <= max(1, num_stages - s) if n else stage.peak_live == 0
    last = results[-1]
    assert float(last.loss_sum) == pytest.approx(sum(2.0 ** num_stages * g for g in ids))
    # d(loss)/d(w) on the first stage: sum over ids of 2^(P-1) * g
    assert float(stages[0].w.grad if n else 0.0) == pytest.approx(
        sum(2.0 ** (num_stages - 1) * g for g in ids))


def test_one_forward_one_backward_in_steady_state():
    stages, _ = run_pipeline(list(range(6)), 3)
    kinds = "".join(k for k, _ in stages[0].events)
    assert kinds == "FF" + "FB" * 4 + "BB"  # warm-up P-1, steady 1F1B, cool-down


def test_forward_only_hands_activations_down():
    stages, results = run_pipeline([1, 2, 3], 3, forward_only=True)
    assert float(results[-1].loss_sum) == pytest.approx(8 * 6)
    assert all(r.ids == [1, 2, 3] for r in results)
