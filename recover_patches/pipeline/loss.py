"""Cross-entropy over vocabulary-sharded logits, reduced on an explicitly given TP group.

megatron-core's `vocab_parallel_cross_entropy` reaches for the global TP group of `parallel_state`;
ReCoVer passes every group in (the groups are rebuilt after failures), hence this version.
The math is the standard one: a numerically stable log-sum-exp whose max, sum of exponentials and
target logit are each all-reduced across the shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        shard = logits.size(-1)
        start = group.rank() * shard if group is not None else 0
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        if group is not None and group.size() > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= shard)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None and group.size() > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss [..] from logits [.., vocab/TP] sharded contiguously over `group`."""
    return _VocabShardedCrossEntropy.apply(logits, target, group)


def masked_loss_sum(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of the counted tokens' losses, left on the device (the token count comes from the
    host copy of the mask: reading it here would make the host wait for the GPU). Normalisation
    by the *global* token count happens after the DP reduction (design.md §8)."""
    return (token_loss * loss_mask.to(token_loss.dtype)).sum()


def on_grid(loss: torch.Tensor, quantum: float) -> torch.Tensor:
    """--recover-exact-reduction: the loss as float64 whose value is rounded to a multiple of
    `quantum` (a power of two), so sums of such values are exact in any order; its gradient is
    the loss's own (the correction onto the grid is exact and outside the graph)."""
    wide = loss.double()
    return wide + (torch.round(wide / quantum) * quantum - wide).detach()
