"""--manual-gc, --manual-gc-interval, --no-manual-gc-eval: the Trainer's loop (train() and
finish_iteration(), run on a stand-in for the rest of the Trainer) disables automatic collection and
collects at the points Megatron-LM does: at the start, every interval, around each evaluation."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from megatron.training.config import BatchSchedule, TrainingConfig
from megatron.training.training import Trainer, Progress


class Loop:
    """What Trainer.train / finish_iteration read besides their config; records what happened."""

    def __init__(self, config: TrainingConfig, events: list) -> None:
        self.config, self.state, self.events = config, Progress(), events
        self.checkpointer, self.grow, self.valid_stages, self.history = None, None, [object()], []
        # the profiler's rank and device; settle() ends start-up's bounds after the first commit
        self.groups = SimpleNamespace(rank=0, settle=lambda: None)
        self.device = torch.device("cpu")

    def transaction(self):
        return self

    def run(self, iteration: int, ids: list[int]):
        self.events.append(("iteration", iteration, gc.isenabled()))
        return SimpleNamespace(sync=None, step={"skipped_step": False})

    def microbatch_ids(self) -> list[int]:
        return [0]

    def record(self, outcome, seconds: float) -> None:
        pass

    def counts_since_last_record(self) -> dict:
        return {}

    def finish_iteration(self) -> None:
        Trainer.finish_iteration(self)  # type: ignore[arg-type]

    def finish_training(self) -> None:
        pass  # (the weight check is off here)

    def evaluate(self) -> None:
        self.events.append(("eval", self.state.iteration))


def events_of(monkeypatch, **flags) -> list:
    gc_options = {"manual_gc": False, "manual_gc_interval": 0, "manual_gc_eval": True, **flags}
    config = TrainingConfig(batches=BatchSchedule(1, 1, None), train_iters=8, eval_interval=4,
                            eval_iters=1, log_interval=1, log_throughput=False, log_memory=False,
                            min_replicas=1, one_optimizer_copy="", **gc_options)
    events: list = []
    loop = Loop(config, events)
    monkeypatch.setattr(gc, "collect", lambda *a: events.append(("collect", loop.state.iteration)))
    try:
        Trainer.train(loop)  # type: ignore[arg-type]
    finally:
        gc.enable()
    return events


def collects(events) -> list[int]:
    return [e[1] for e in events if e[0] == "collect"]


def test_manual_gc_collects_at_start_every_interval_and_around_evaluations(monkeypatch):
    events = events_of(monkeypatch, manual_gc=True, manual_gc_interval=3)
    assert [e[2] for e in events if e[0] == "iteration"] == [False] * 8  # no automatic collection
    # start; after 3; eval at 4 (before, after); after 6; eval at 8 (before, after)
    assert collects(events) == [0, 3, 4, 4, 6, 8, 8]
    assert events.index(("collect", 4)) < events.index(("eval", 4)) < len(events) - 1


def test_no_interval_and_no_eval_collection(monkeypatch):
    assert collects(events_of(monkeypatch, manual_gc=True)) == [0, 4, 4, 8, 8]
    assert collects(events_of(monkeypatch, manual_gc=True, manual_gc_eval=False)) == [0]


def test_without_manual_gc_python_collects_as_usual(monkeypatch):
    events = events_of(monkeypatch, manual_gc=False, manual_gc_interval=3)
    assert collects(events) == []
    assert all(e[2] for e in events if e[0] == "iteration")  # automatic collection stays on


@pytest.fixture(autouse=True)
def _gc_back_on():
    yield
    gc.enable()
