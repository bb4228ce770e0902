"""The proof that schedule, p2p, DP reduction, loss normalisation and clipping are right: every
(TP, PP, DP) layout trains the tiny GPT along the single-process trajectory."""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

ITERS = ["--train-iters", "6"]
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 2, 4)]  # (TP, PP, DP)


def _train(tmp_path_factory, tp: int, pp: int, dp: int):
    out = tmp_path_factory.mktemp(f"tp{tp}pp{pp}dp{dp}")
    run = launch(tp * pp * dp, [*TINY_GPT, *ITERS, "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp)], out / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.losses()) == 6, run.stdout[-2000:]
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory, 1, 1, 1)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_layout_matches_single_process(reference, tmp_path_factory, tp, pp, dp):
    run = _train(tmp_path_factory, tp, pp, dp)
    ref = reference.records
    # the reference must actually learn and clip, or equality would prove little
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]
    assert any(r["grad_norm"] > 1.0 for r in ref), "clipping never engaged in the reference"
    for mine, theirs in zip(run.records, ref):
        assert mine["microbatches"] == theirs["microbatches"] == 8
        assert mine["tokens"] == theirs["tokens"]
        assert _rel(mine["lm_loss"], theirs["lm_loss"]) <= 1e-5, (mine, theirs)
        assert _rel(mine["grad_norm"], theirs["grad_norm"]) <= 1e-4, (mine, theirs)
    assert {int(r) for r in run.records[0]["quotas"]} == set(range(dp))
