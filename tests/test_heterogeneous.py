"""Layer 3 in the running trainer: a replica slowed down (`slow` fault) is measured, and the next
plans give it fewer microbatches, which shortens the iteration versus the even split."""
from __future__ import annotations

import statistics

import pytest

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.multiprocess  # every test here starts several processes


@pytest.mark.timeout(300)
def test_slow_replica_gets_fewer_microbatches(tmp_path):
    run = launch(2, [*TINY_GPT, "--train-iters", "8", "--inject-fault", "slow:rank=1,seconds=0.15"],
                 tmp_path / "metrics.jsonl", launcher_args=[], timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    records = [r for r in run.records if "lm_loss" in r]
    assert records[0]["quotas"] == {"0": 4, "1": 4}  # nothing measured yet: the even split
    late = records[3:]
    assert all(r["quotas"]["1"] < r["quotas"]["0"] for r in late), [r["quotas"] for r in records]
    assert all(r["microbatches"] == 8 for r in records)
    # an even split would cost at least replica 1's sleep, 4 x 150 ms, every iteration
    assert statistics.median(r["ms_per_iteration"] for r in late) < 4 * 150
