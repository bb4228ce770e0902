"""Gated attention (`--attention-output-gate`): megatron-core's query projection also gives a
gate per head, whose sigmoid multiplies the attention's output. TP 2 splits the gate with its
heads and follows one process."""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

ITERS = 3
FLAGS = [*TINY_GPT, "--train-iters", str(ITERS), "--attention-output-gate"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gated_attention_at_tp_2_follows_one_process(tmp_path):
    runs = [launch(1, FLAGS, tmp_path / "one.jsonl"),
            launch(2, [*FLAGS, "--tensor-model-parallel-size", "2"], tmp_path / "tp2.jsonl"),
            launch(1, FLAGS[:-1], tmp_path / "ungated.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    one, tp2, ungated = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert len(one) == len(tp2) == ITERS
    for mine, ref in zip(tp2, one):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine, ref)
    assert abs(one[0]["lm_loss"] - ungated[0]["lm_loss"]) > 1e-4  # the gate is there
