"""Gated delta net layers (`--experimental-attention-variant gated_delta_net`): megatron-core's
GatedDeltaNet on the layers --linear-attention-freq names. Without flash-linear-attention its own
torch path of the chunked rule runs, checked here against the recurrence written out step by
step; DP 2 with a rank killed, and PP 2, keep one process's losses; one process resumes PP 2's
checkpoint; what is not built yet is one line naming the flag."""
from __future__ import annotations

import math

import pytest
import torch
from megatron.core.ssm import gated_delta_net
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron.training.arguments import parse_and_validate
from megatron.training.checkpointing import LATEST_FILE
from megatron.training.config import ModelConfig
from megatron.training.config.rules import megatron_differences
from megatron.training.model import TorchNorm
from megatron.training.model.gated_delta_net import l2norm, with_linear_attention
from tests.test_mla import on_a_transformer_engine_node
from tests._launch_util import TINY_GPT, launch

ITERS = 4
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
       "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
       "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--normalization", "RMSNorm"]
PLAIN = [*TINY_GPT, "--train-iters", str(ITERS), "--normalization", "RMSNorm",
         "--recover-balance", "even"]
FLAGS = [*PLAIN, *GDN]
# as Megatron-LM's gated delta net jobs (Qwen3-Next's layers): experts with a gated shared expert,
# gated softmax attention, zero-centred norms, split over TP 2 with sequence parallelism
HYBRID = [*FLAGS, "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
          "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
          "--attention-output-gate", "--disable-bias-linear", "--apply-layernorm-1p"]


def gated_delta_recurrence(q, k, v, g, beta):
    """The gated delta rule one step at a time ([batch, seq, heads, dim] inputs): the state
    decays by exp(g), then moves its read-out of k towards v by beta; the output reads q."""
    batch, seq, heads, dk = k.shape
    state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64)
    q = q.double() / math.sqrt(dk)
    out = torch.empty(batch, seq, heads, v.shape[-1], dtype=torch.float64)
    for t in range(seq):
        k_t, v_t = k[:, t].double(), v[:, t].double()
        state = state * g[:, t].double().exp()[..., None, None]
        error = v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, error * beta[:, t, :, None])
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


@pytest.mark.parametrize("seq, chunk", [(13, 4), (16, 16), (5, 8)])
def test_megatron_cores_torch_rule_is_the_gated_delta_recurrence(seq, chunk):
    gen = torch.Generator().manual_seed(seq)
    q, k = (l2norm(torch.randn(2, seq, 3, 8, generator=gen)) for _ in range(2))
    v = torch.randn(2, seq, 3, 6, generator=gen)
    g = -torch.rand(2, seq, 3, generator=gen)  # log decay: -A exp softplus(...) < 0
    beta = torch.rand(2, seq, 3, generator=gen)
    out, _ = gated_delta_net.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta,
                                                          chunk_size=chunk)
    assert torch.allclose(out.double(), gated_delta_recurrence(q, k, v, g, beta), atol=1e-5)


def test_the_l2_norm_is_flas():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16)
    y = l2norm(x)
    assert y.dtype == torch.bfloat16
    expected = torch.tensor([[0.6, 0.8], [0.0, 0.0]], dtype=torch.bfloat16)
    assert torch.equal(y, expected)


def test_each_stage_puts_gated_delta_nets_on_megatron_cores_layers():
    """4 layers, --linear-attention-freq "[1,0,0,1]": layers 1 and 4 are gated delta nets;
    PP 2's second stage gets layers 3 and 4."""
    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               experimental_attention_variant="gated_delta_net",
                               linear_attention_freq=[1, 0, 0, 1])
    plain = object()
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                             TransformerLayerSubmodules)
    layer = ModuleSpec(module=TransformerLayer,
                       submodules=TransformerLayerSubmodules(self_attention=plain))
    kinds = []
    for stage in (0, 1):
        block = with_linear_attention(TransformerBlockSubmodules(layer_specs=[layer, layer]),
                                      config, TorchNorm, None, stage)
        kinds += ["plain" if s.submodules.self_attention is plain else
                  s.submodules.self_attention.module.__name__ for s in block.layer_specs]
    assert kinds == ["EagerGatedDeltaNet", "plain", "plain", "EagerGatedDeltaNet"]
    assert layer.submodules.self_attention is plain  # the shared spec is left alone


def test_decay_rates_and_convolutions_start_as_megatron_core_draws_them():
    """A_log = log U(1, 16) and the convolution torch's default U(+-1/sqrt(width)), by name
    like every other parameter (not the normal law of --init-method-std)."""
    from megatron.training.model.initialization import init_parameters_by_name

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_number = 1
            self.self_attention = torch.nn.Module()
            self.self_attention.A_log = torch.nn.Parameter(torch.rand(4000))
            self.self_attention.conv1d = torch.nn.Conv1d(500, 500, 4, groups=500, bias=False)

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([Layer()])
    init_parameters_by_name(model, seed=3, std=0.02, num_layers=1, tp_size=1, tp_rank=0)
    attention = model.decoder.layers[0].self_attention
    a = attention.A_log.exp()
    assert 1.0 <= a.min() < 1.1 and 15.9 < a.max() <= 16.0
    w = attention.conv1d.weight
    assert -0.5 <= w.min() < -0.49 and 0.49 < w.max() <= 0.5  # width 4: bound 1/2


@pytest.mark.parametrize("given, said", [
    (["--experimental-attention-variant", "gdn2"], "gdn2 is not supported yet"),
    (["--linear-attention-freq", "[1,0,1]"], "gives 3 layers, the model has --num-layers 4"),
    (["--linear-num-value-heads", "3"], "is not a multiple of --linear-num-key-heads 2"),
    (["--tensor-model-parallel-size", "2", "--linear-num-key-heads", "1",
      "--linear-num-value-heads", "2"], "--linear-num-key-heads 1 does not split over"),
    (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported yet")])
def test_what_gated_delta_nets_do_not_take_yet_is_one_line(given, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*FLAGS, *given], world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and said in err, err


def test_a_transformer_engine_gated_delta_net_recipe_runs_on_local_layers_and_says_so():
    args = on_a_transformer_engine_node(FLAGS)
    assert ModelConfig.from_args(args, 256).implementation == "local"
    assert any(line.startswith("--transformer-impl transformer_engine:") and "gated delta nets"
               in line for line in megatron_differences(args, "cuda"))


def test_a_variant_without_its_layer_pattern_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_and_validate([*PLAIN, "--experimental-attention-variant", "gdn"], world_size=1)
    assert "needs --linear-attention-freq" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_killed_rank_in_a_gated_delta_net_job_keeps_one_process_losses(tmp_path):
    """DP 2, rank 1 killed in a backward of iteration 2: replica 0 recomputes its microbatches
    in the same iteration. PP 2 (two gated delta nets, then one and a softmax layer) follows one
    process, and one process resumes from its checkpoint of iteration 2. Plain attention in
    every layer gives other losses: the gated delta nets are there. The hybrid with experts at
    TP 2 with sequence parallelism (each rank its heads' part of every projection) follows its
    one-process run, and one process resumes from its checkpoint of iteration 2."""
    runs = [launch(1, FLAGS, tmp_path / "one.jsonl"),
            launch(2, [*FLAGS, "--recover-spares", "off",
                       "--inject-fault", "kill:rank=1,iter=2,phase=backward"],
                   tmp_path / "two.jsonl", launcher_args=[], timeout=240),
            launch(2, [*FLAGS, "--pipeline-model-parallel-size", "2", "--save",
                       str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path / "pp2.jsonl"),
            launch(1, PLAIN, tmp_path / "plain.jsonl"),
            launch(1, HYBRID, tmp_path / "hybrid.jsonl"),
            launch(2, [*HYBRID, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--save", str(tmp_path / "ckpt_tp2"), "--save-interval", "2"],
                   tmp_path / "hybrid_tp2.jsonl")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    one, two, pp2, plain, hybrid, hybrid_tp2 = ([r for r in run.records if "lm_loss" in r]
                                                for run in runs)
    for mine, ref in zip(hybrid_tp2, hybrid, strict=True):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine, ref)
    for mine, ref in zip(pp2, one, strict=True):
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
    assert [r["live_replicas"] for r in two] == [[0, 1]] + [[0]] * (ITERS - 1)
    for mine, ref in zip(two, one, strict=True):
        assert mine["microbatches"] == 8, mine
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
    assert abs(one[0]["lm_loss"] - plain[0]["lm_loss"]) > 1e-4
    (tmp_path / "ckpt" / LATEST_FILE).write_text("2")
    resumed = launch(1, [*FLAGS, "--load", str(tmp_path / "ckpt")], tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert all(abs(a - b["lm_loss"]) <= 1e-5 * b["lm_loss"]
               for a, b in zip(resumed.losses(), one[2:], strict=True)), resumed.losses()
    # TP 2's sections of the stacked projections, read back whole by one process
    (tmp_path / "ckpt_tp2" / LATEST_FILE).write_text("2")
    whole = launch(1, [*HYBRID, "--load", str(tmp_path / "ckpt_tp2")], tmp_path / "whole.jsonl")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert all(abs(a - b["lm_loss"]) <= 1e-5 * b["lm_loss"]
               for a, b in zip(whole.losses(), hybrid[2:], strict=True)), whole.losses()
