"""Attention variants: gated attention (`--attention-output-gate`: the query projection also
gives a gate per head, whose sigmoid multiplies the attention's output) and L2-normalised
queries and keys (`--qk-l2-norm`), megatron-core's, which TP 2 splits with their heads and which
follow one process; and sliding-window attention (`--window-size`), which ReCoVer's attention
masks, against attention written out with a loop."""
from __future__ import annotations

import pytest
import torch

from tests._launch_util import TINY_GPT, launch

ITERS = 3
PLAIN = [*TINY_GPT, "--train-iters", str(ITERS)]
FLAGS = [*PLAIN, "--attention-output-gate", "--qk-l2-norm", "--window-size", "4,0",
         "--window-attn-skip-freq", "2"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gated_windowed_attention_with_l2_normed_heads_at_tp_2_follows_one_process(tmp_path):
    runs = [launch(1, FLAGS, tmp_path / "one.jsonl"),
            launch(2, [*FLAGS, "--tensor-model-parallel-size", "2"], tmp_path / "tp2.jsonl"),
            launch(1, PLAIN, tmp_path / "plain.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    one, tp2, plain = ([r for r in run.records if "lm_loss" in r] for run in runs)
    assert len(one) == len(tp2) == ITERS
    for mine, ref in zip(tp2, one):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine, ref)
    assert abs(one[0]["lm_loss"] - plain[0]["lm_loss"]) > 1e-4  # the variants are there


def reference_window_attention(q, k, v, left: int) -> torch.Tensor:
    """Causal attention of each query over its last LEFT + 1 keys, written out with a loop."""
    seq, out = q.size(0), torch.empty_like(v)
    for i in range(seq):
        lo = 0 if left < 0 else max(0, i - left)
        scores = torch.einsum("bhd,sbhd->bhs", q[i], k[lo:i + 1]) / q.size(-1) ** 0.5
        out[i] = torch.einsum("bhs,sbhd->bhd", scores.softmax(-1), v[lo:i + 1])
    return out


@pytest.mark.parametrize("window", [(3, 0), (0, 0), (-1, 0), (2, 5)])
def test_sliding_window_attention_sees_the_band_only(window):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.training.model import SDPACoreAttention
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               window_size=window, attention_dropout=0.0)
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(9, 2, 2, 8, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    got = attention(q, k, v, None).reshape(9, 2, 2, 8)
    assert torch.allclose(got, reference_window_attention(q, k, v, window[0]), atol=1e-5)
    from megatron.training.model import windowed  # the band is built once per shape, then read
    assert windowed(window, 9, None, q.device) is windowed(window, 9, None, q.device)


def test_the_skip_frequency_leaves_every_nth_layer_whole():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.training.model import SDPACoreAttention
    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2,
                               window_size=(3, 0), window_attn_skip_freq=2)
    windows = [SDPACoreAttention(config, n, AttnMaskType.causal, "self").window
               for n in range(1, 5)]
    assert windows == [(3, 0), None, (3, 0), None]  # megatron-core's rule: layer % N != 0


@pytest.mark.parametrize("given, said", [
    (["--window-size", "4"], "is not LEFT,RIGHT"),
    (["--window-size", "4,0", "--window-attn-skip-freq", "[1,0]"], "--num-layers 4"),
    (["--window-size", "4,0", "--context-parallel-size", "2"], "not supported yet")])
def test_a_window_that_cannot_be_taken_is_one_line(given, said, capsys):
    from megatron.training.arguments import parse_and_validate
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*PLAIN, *given], world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and said in err, err
