"""Multi-latent attention split over TP. megatron-core 0.16.1's MLASelfAttention gathers its
down projections' outputs (each TP rank projects a share of the latent's width) without naming
the TP group, so the gather would look the group up in parallel_state, which ReCoVer does not set
up (its groups are rebuilt in recovery). A hook on each down projection hands the latent over
whole, gathered over the projection's own group, and back in sequence shards under sequence
parallelism: then megatron-core's own gather is skipped, as for a projection that is not split.

The keys' rope part is shared by all heads, and each TP rank's heads give only their part of its
gradient. Under sequence parallelism megatron-core's gather of it sums that over TP in the
backward; without, nothing does, so the hook passes it through an identity whose backward is the
TP sum. (megatron-core's copy to the tensor-parallel region would not do: its backward reduces a
contiguous copy of a non-contiguous gradient, and this one is a slice, and returns the original.)"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    scatter_to_sequence_parallel_region)


class _SumGradientOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _whole_query_latent(projection: ColumnParallelLinear, inputs, output):
    latent, bias = output
    latent = gather_from_tensor_model_parallel_region(latent, group=projection.tp_group)
    if projection.config.sequence_parallel:
        latent = scatter_to_sequence_parallel_region(latent, group=projection.tp_group)
    return latent, bias


def _whole_key_value_latent(projection: ColumnParallelLinear, inputs, output):
    """[latent, rope] whole; without sequence parallelism the rope's gradient summed over TP."""
    config, group = projection.config, projection.tp_group
    latent, bias = output
    latent = gather_from_tensor_model_parallel_region(latent, group=group)
    if config.sequence_parallel:
        return scatter_to_sequence_parallel_region(latent, group=group), bias
    kv, rope = torch.split(latent, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
    rope = _SumGradientOverTP.apply(rope, group)
    return torch.cat([kv, rope], dim=-1), bias


_HOOKS = {"linear_q_down_proj": _whole_query_latent,
          "linear_kv_down_proj": _whole_key_value_latent}


def gather_latents_with_their_group(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        hook = _HOOKS.get(name.rsplit(".", 1)[-1])
        if hook is not None:
            module.register_forward_hook(hook)
