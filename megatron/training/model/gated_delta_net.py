"""Gated delta net layers (--experimental-attention-variant gated_delta_net): megatron-core's
GatedDeltaNet in place of the attention of the layers --linear-attention-freq names, in ReCoVer's
layer specs (megatron-core builds its hybrid block from transformer-engine modules only).

Without flash-linear-attention (fla: triton kernels, which never run on a CPU) megatron-core
0.16.1's GatedDeltaNet refuses to build, and it takes its q/k L2 norm and its chunked delta rule
from fla. There its own torch path of the rule (`torch_chunk_gated_delta_rule`, which it runs under
--deterministic-mode) stands in, with an L2 norm of fla's definition.
"""
from __future__ import annotations

import copy
import importlib.util

import torch
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern)
from megatron.core.ssm import gated_delta_net
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps) over the last dimension, in fp32, returned in x's
    dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim, keepdim=True) + eps)).to(x.dtype)


def use_torch_gated_delta_rule() -> None:
    """Without fla: megatron-core's torch path of the rule and a torch L2 norm, where its module
    looks them up (its globals: the only way in)."""
    if importlib.util.find_spec("fla") is not None:
        return
    gated_delta_net.HAVE_FLA = True  # its constructor's check: what fla gave is now here
    gated_delta_net.l2norm = l2norm
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule


class RecoverGatedDeltaNet(gated_delta_net.GatedDeltaNet):
    """megatron-core's GatedDeltaNet, its TP-split parameters described for initialisation by
    name: the dimension each is split along, and for the stacked projections the sections each
    split over TP (every rank holds its part of each: megatron-core's layout)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        qk, v, heads = self.qk_dim, self.v_dim, self.num_value_heads
        # in_proj gives [q, k, v, output gate, beta, alpha]; the convolution runs over [q, k, v]
        setattr(self.in_proj.weight, "tp_sections", (qk, qk, v, v, heads, heads))
        setattr(self.conv1d.weight, "tp_sections", (qk, qk, v))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            setattr(param, "partition_dim", 0)


class EagerGatedDeltaNet(RecoverGatedDeltaNet):
    """With its output norm and gate run as written, not through torch.compile: compiling that
    small function takes about 20 s per process on a CPU."""
    _apply_gated_norm = gated_delta_net.GatedDeltaNet._apply_gated_norm.__wrapped__


def gated_delta_net_spec(norm: type) -> ModuleSpec:
    """megatron-core's GatedDeltaNet with local modules: the layer's own input norm before
    `in_proj` (transformer-engine fuses the two), `norm` on each value head's output."""
    on_gpu = torch.cuda.is_available()
    return ModuleSpec(module=RecoverGatedDeltaNet if on_gpu else EagerGatedDeltaNet,
                      submodules=gated_delta_net.GatedDeltaNetSubmodules(
                          in_proj=ColumnParallelLinear, out_norm=norm,
                          out_proj=RowParallelLinear))


def with_linear_attention(block: TransformerBlockSubmodules, config: TransformerConfig,
                          norm: type, vp_stage: int | None, pp_rank: int
                          ) -> TransformerBlockSubmodules:
    """This chunk's layer specs with a gated delta net in the layers megatron-core's pattern
    makes linear (counted by global layer number, whichever stage builds the layer)."""
    pattern = get_linear_attention_pattern(config)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = []
    for number, spec in enumerate(block.layer_specs, start=first):
        if pattern[number]:
            spec = copy.copy(spec)  # layers share their spec object: change this one only
            spec.submodules = copy.copy(spec.submodules)
            spec.submodules.self_attention = gated_delta_net_spec(norm)
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=block.layer_norm)
