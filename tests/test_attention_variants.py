"""Attention variants megatron-core builds, taken as they are: gated attention
(`--attention-output-gate`: the query projection also gives a gate per head, whose sigmoid
multiplies the attention's output) and L2-normalised queries and keys (`--qk-l2-norm`). TP 2
splits both with their heads and follows one process."""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

ITERS = 3
FLAGS = [*TINY_GPT, "--train-iters", str(ITERS), "--attention-output-gate", "--qk-l2-norm"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gated_attention_with_l2_normed_heads_at_tp_2_follows_one_process(tmp_path):
    runs = [launch(1, FLAGS, tmp_path / "one.jsonl"),
            launch(2, [*FLAGS, "--tensor-model-parallel-size", "2"], tmp_path / "tp2.jsonl"),
            launch(1, FLAGS[:-2], tmp_path / "plain.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    one, tp2, plain = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert len(one) == len(tp2) == ITERS
    for mine, ref in zip(tp2, one):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine, ref)
    assert abs(one[0]["lm_loss"] - plain[0]["lm_loss"]) > 1e-4  # the variants are there
