"""Seeding a microbatch's dropout streams on a CPU host: the same draws as `torch.manual_seed`,
without the CUDA seeding it queues (formatting the stack each time) for a CUDA never initialised."""
from __future__ import annotations

import traceback

import torch

from recover_patches.pipeline.rng import DeviceRNGStatesTracker, derive_seed, seed_microbatch


def test_the_hidden_stream_draws_what_torch_manual_seed_would():
    tracker = DeviceRNGStatesTracker("cpu")
    seed_microbatch(tracker, 1234, microbatch_id=5, pp_stage=1, tp_rank=0)
    drawn = torch.rand(8)
    torch.manual_seed(derive_seed(1234, 5, 1))
    assert torch.equal(drawn, torch.rand(8))


def test_no_cuda_seeding_is_queued_on_a_cpu_host(monkeypatch):
    # torch.cuda keeps a seeding asked for before CUDA is initialised, with the stack it formats
    formatted: list[int] = []
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: formatted.append(1) or [])
    tracker = DeviceRNGStatesTracker("cpu")
    for microbatch in range(5):
        seed_microbatch(tracker, 7, microbatch, pp_stage=0, tp_rank=0)
    assert formatted == []
