"""--profile --use-pytorch-profiler: a chrome trace per profiled rank with exactly the iterations
Megatron-LM's schedule records, nothing on the ranks --profile-ranks leaves out."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from megatron.training.profiling import Profiler, ProfilingConfig


def traced_iterations(tmp_path, rank: int, start: int, end: int, ranks=()) -> list[int] | None:
    config = ProfilingConfig(True, start, end, pytorch=True, ranks=tuple(ranks),
                             trace_dir=tmp_path)
    profiler = Profiler(config, rank, cuda=False)
    for done in range(end + 3):  # the trainer's loop: `done` iterations completed
        profiler.before(done)
        with torch.profiler.record_function(f"iteration-{done + 1}"):
            torch.randn(16, 16) @ torch.randn(16, 16)
        profiler.after(done + 1)
    profiler.close()
    path = tmp_path / f"rank-{rank}.json.gz"
    if not path.exists():
        return None
    events = json.loads(gzip.open(path).read())["traceEvents"]
    return sorted({int(e["name"].split("-")[1]) for e in events
                   if e.get("name", "").startswith("iteration-")})


@pytest.mark.parametrize("start, end", [(1, 3), (5, 8)])
def test_the_trace_holds_megatrons_window(tmp_path, start, end):
    assert traced_iterations(tmp_path, 0, start, end) == list(range(start, end))


def test_a_rank_left_out_writes_nothing(tmp_path):
    assert traced_iterations(tmp_path, 3, 1, 3, ranks=[0, 1]) is None
    assert traced_iterations(tmp_path, 1, 1, 3, ranks=[0, 1]) == [1, 2]
