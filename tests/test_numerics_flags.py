"""Megatron-LM's model and optimizer numerics flags reach megatron-core, each checked against
the same run without it."""
from __future__ import annotations

import logging

import pytest
import torch

from recover_patches.log import PACKAGES, configure, set_level
from tests.test_checkpoint_dist import GPTTrainer, make_args


@pytest.fixture(scope="module", autouse=True)
def _one_rank(one_rank_group):  # conftest's: the groups need a default group
    yield


def built(tmp_path, *flags: str) -> GPTTrainer:
    return GPTTrainer(make_args(tmp_path, *flags))


def named(trainer: GPTTrainer) -> dict[str, torch.Tensor]:
    return dict(trainer.model.named_parameters())


def test_norm_epsilon_and_qkv_bias(tmp_path):
    trainer = built(tmp_path, "--norm-epsilon", "1e-3", "--disable-bias-linear",
                    "--add-qkv-bias")
    assert trainer.model.decoder.layers[0].input_layernorm.eps == 1e-3
    params = named(trainer)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in params
    assert "decoder.layers.0.mlp.linear_fc1.bias" not in params
    plain = named(built(tmp_path, "--disable-bias-linear"))
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in plain


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_scales_by_one_plus_a_weight_starting_at_zero(tmp_path, normalization):
    """transformer-engine's zero-centred gamma, in the local norms: at the start the same outputs
    as the plain norm's (weight 1), later 1 + weight where the plain norm has weight."""
    norm = built(tmp_path, "--apply-layernorm-1p", "--normalization",
                 normalization).model.decoder.layers[0].input_layernorm
    plain = built(tmp_path, "--normalization", normalization).model.decoder.layers[0] \
        .input_layernorm
    assert torch.count_nonzero(norm.weight) == 0
    x = torch.randn(3, norm.weight.numel())
    assert torch.allclose(norm(x), plain(x))
    with torch.no_grad():
        norm.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    assert torch.allclose(norm(x), plain(x))


def test_qk_l2_norm_builds_megatron_cores_l2_norms_in_place_of_the_layernorms(tmp_path):
    from megatron.core.transformer.torch_norm import L2Norm
    attention = built(tmp_path, "--qk-l2-norm", "--qk-layernorm").model.decoder.layers[0] \
        .self_attention
    assert isinstance(attention.q_layernorm, L2Norm) and isinstance(attention.k_layernorm, L2Norm)
    layernormed = built(tmp_path, "--qk-layernorm").model.decoder.layers[0].self_attention
    assert not isinstance(layernormed.q_layernorm, L2Norm)


def test_rope_flags(tmp_path):
    old_spelling = built(tmp_path, "--use-rotary-position-embeddings")
    assert old_spelling.model.position_embedding_type == "rope"
    plain = old_spelling.model.rotary_pos_emb
    scaled = built(tmp_path, "--position-embedding-type", "rope", "--use-rope-scaling",
                   "--rope-scaling-factor", "4").model.rotary_pos_emb
    assert not torch.equal(plain.inv_freq, scaled.inv_freq)  # Llama 3.x low frequencies
    stretched = built(tmp_path, "--position-embedding-type", "rope",
                      "--rotary-seq-len-interpolation-factor", "2").model.rotary_pos_emb
    assert stretched.seq_len_interpolation_factor == 2 and plain.seq_len_interpolation_factor \
        is None


def _group_of(trainer: GPTTrainer, name: str) -> dict:
    param = named(trainer)[name]
    for group in trainer.optimizer.param_groups:
        if any(p is param or getattr(p, "_base", None) is param for p in group["params"]):
            return group
    main = trainer.optimizer.main_params[trainer.optimizer.model_params.index(param)]
    return next(g for g in trainer.optimizer.param_groups if any(p is main for p in g["params"]))


def test_weight_decay_on_qk_layernorm(tmp_path):
    weight = "decoder.layers.0.self_attention.q_layernorm.weight"
    decayed = built(tmp_path, "--qk-layernorm", "--apply-wd-to-qk-layernorm")
    assert _group_of(decayed, weight)["wd_mult"] == 1.0
    assert _group_of(built(tmp_path, "--qk-layernorm"), weight)["wd_mult"] == 0.0
    # the other 1-D parameters still skip it
    assert _group_of(decayed, "decoder.layers.0.input_layernorm.weight")["wd_mult"] == 0.0


def test_decoupled_learning_rate(tmp_path):
    trainer = built(tmp_path, "--decoupled-lr", "5e-4", "--decoupled-min-lr", "1e-5",
                    "--lr-decay-style", "cosine", "--min-lr", "1e-4")
    trainer.scheduler.step(increment=1)
    embedding = _group_of(trainer, "embedding.word_embeddings.weight")
    other = _group_of(trainer, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert (embedding["max_lr"], embedding["min_lr"]) == (5e-4, 1e-5)
    assert (other["max_lr"], other["min_lr"]) == (1e-3, 1e-4)
    assert embedding["lr"] != other["lr"]


def test_logging_level_survives_a_later_configure():
    try:
        set_level(logging.WARNING)
        configure(0, stream="stdout")  # a standby that got its rank configures again
        assert logging.getLogger().level == logging.WARNING
        assert all(logging.getLogger(p).level == logging.WARNING for p in PACKAGES)
    finally:
        set_level(logging.INFO)
        logging.getLogger().setLevel(logging.WARNING)  # the root's default


def test_activation_flags_choose_megatron_cores_functions(tmp_path):
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    plain = built(tmp_path).model.config
    assert plain.activation_func is torch.nn.functional.gelu and not plain.gated_linear_unit
    relu2 = built(tmp_path, "--squared-relu").model.config
    assert relu2.activation_func is squared_relu and not relu2.gated_linear_unit
    geglu = built(tmp_path, "--quick-geglu", "--glu-linear-offset", "1.0",
                  "--activation-func-clamp-value", "7.0")
    config = geglu.model.config
    assert config.activation_func is quick_gelu and config.gated_linear_unit
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    fc1 = named(geglu)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape[0] == 2 * config.ffn_hidden_size  # gated: both halves
    losses = [built(tmp_path, *flags).train_step()
              for flags in ([], ["--squared-relu"], ["--quick-geglu"])]
    assert len(set(losses)) == 3  # each activation computes something else
