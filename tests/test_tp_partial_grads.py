"""Gradients each TP rank holds only a part of are summed over TP before the step.

Under transformer-engine layers, per-head q/k norms are TE norms whose parameters carry
`sequence_parallel = config.sequence_parallel`: False without --sequence-parallel, though each TP
rank's norm sees only its own heads. Megatron's finalize_model_grads sums them by name. The
stand-in here carries what matters of a TE norm (the attribute, megatron-core's module names)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.training.optimizer import sync_sequence_parallel_grads, tp_partial_grads
from tests.gloo_ranks import run_ranks


class TENormStandIn(torch.nn.Module):
    """A transformer-engine norm as megatron-core's TE spec builds it without sequence
    parallelism: a weight flagged sequence_parallel=False."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        setattr(self.weight, "sequence_parallel", False)  # what TE sets from the config


def attention_stand_in() -> torch.nn.Module:
    """decoder.layers.0.self_attention.{q_layernorm, k_layernorm, linear_proj} and a
    sequence-parallel layer norm, under megatron-core's names."""
    attention = torch.nn.Module()
    attention.q_layernorm, attention.k_layernorm = TENormStandIn(4), TENormStandIn(4)
    attention.linear_proj = torch.nn.Linear(8, 8)
    layer = torch.nn.Module()
    layer.self_attention = attention
    layer.input_layernorm = TENormStandIn(8)
    setattr(layer.input_layernorm.weight, "sequence_parallel", True)  # under --sequence-parallel
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


def test_te_qk_norms_are_picked_by_name_and_flagged_norms_by_their_flag():
    model = attention_stand_in()
    names = [name for name, _ in model.named_parameters()]
    picked = dict(zip(names, tp_partial_grads(model, list(model.parameters()))))
    assert picked == {"decoder.layers.0.self_attention.q_layernorm.weight": True,
                      "decoder.layers.0.self_attention.k_layernorm.weight": True,
                      "decoder.layers.0.self_attention.linear_proj.weight": False,
                      "decoder.layers.0.self_attention.linear_proj.bias": False,
                      "decoder.layers.0.input_layernorm.weight": True}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_mla_latent_norms_are_whole_on_each_tp_rank_unless_sequence_parallel(sequence_parallel):
    """Multi-latent attention's latents are gathered whole before their norms, so the norms'
    gradients are whole on each TP rank (megatron-core names the query's q_layernorm all the
    same); ReCoVer's per-head q/k norms are partial at TP > 1. Summing a whole gradient over TP
    would not show in a few Adam steps (scale-free), hence this check of the selection."""
    from megatron.core.transformer import TransformerConfig

    from megatron.training.model.norms import LatentNorm, TorchNorm
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               tensor_model_parallel_size=2, sequence_parallel=sequence_parallel,
                               normalization="RMSNorm")
    attention = torch.nn.Module()
    attention.q_layernorm, attention.kv_layernorm = LatentNorm(config, 6), LatentNorm(config, 5)
    per_head = torch.nn.Module()
    per_head.q_layernorm = TorchNorm(config, 4)
    model = torch.nn.ModuleDict({"mla": attention, "gqa": per_head})
    picked = dict(zip((n for n, _ in model.named_parameters()),
                      tp_partial_grads(model, list(model.parameters()))))
    assert picked == {"mla.q_layernorm.weight": sequence_parallel,
                      "mla.kv_layernorm.weight": sequence_parallel,
                      "gqa.q_layernorm.weight": True}


def _tp_rank(rank: int) -> None:
    model = attention_stand_in()
    params = list(model.parameters())
    grads = [torch.full_like(p, float(rank + 1)) for p in params]  # each rank's part
    sync_sequence_parallel_grads(grads, tp_partial_grads(model, params), dist.group.WORLD)
    names = [name for name, _ in model.named_parameters()]
    for name, g in zip(names, grads):
        summed = "layernorm" in name
        assert torch.equal(g, torch.full_like(g, 3.0 if summed else float(rank + 1))), name


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_te_qk_norm_gradients_are_summed_over_tp_without_sequence_parallel():
    assert run_ranks(_tp_rank, 2) == []
