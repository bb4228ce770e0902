"""AdamW over megatron-core's parameter groups, megatron-core's LR/WD scheduler, and gradient
finalisation that is correct across TP and PP (tied-embedding sync, global-norm clipping).

megatron-core's `get_megatron_optimizer` and DDP assume CUDA; the pieces used here do not.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.AdamW:
    """Weight decay is skipped for biases and 1-D parameters (megatron-core's standard groups).
    Note: `_get_param_groups` agrees on group keys with an all_gather_object on the default group,
    so every rank must call this at start-up (bootstrap, before any failure can matter)."""
    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                             weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                             adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             clip_grad=args.clip_grad)
    groups = _get_param_groups([model], config, None)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps, weight_decay=args.weight_decay)


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Megatron steps the scheduler in samples: one iteration advances it by the global batch."""
    gbs = args.global_batch_size
    if args.train_iters:
        decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_iters * gbs)
    else:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                        else args.lr_warmup_samples)
    start_wd = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end_wd = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=int(warmup_steps), lr_decay_steps=int(decay_steps),
        lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=int(wd_incr_steps), wd_incr_style=args.weight_decay_incr_style)


def sync_tied_embedding_grads(params: Sequence[torch.nn.Parameter], embedding_group) -> None:
    """With PP > 1 the first and last stage each hold a copy of the tied word embeddings; their
    gradients are summed so both copies take the same step."""
    tied = [p for p in params if getattr(p, "tied_embedding_copy", False)]
    if embedding_group is None or embedding_group.size() < 2:
        return
    for p in tied:
        dist.all_reduce(p.grad, group=embedding_group)


def grad_norm_squared_local(params: Sequence[torch.nn.Parameter], tp_rank: int) -> torch.Tensor:
    """This rank's share of the replica's squared gradient norm: each parameter counted once --
    TP-replicated ones only on TP rank 0, the last stage's tied-embedding copy not at all."""
    total = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is None or getattr(p, "tied_embedding_is_duplicate", False):
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        total += p.grad.double().pow(2).sum()
    return total


def clip_grads(params: Sequence[torch.nn.Parameter], max_norm: float, model_parallel_group,
               tp_rank: int) -> float:
    """Global gradient norm over the replica's TP x PP ranks; scale by max_norm/norm if larger.
    Gradients are identical on every replica after the DP reduction, so is the clip factor."""
    norm_sq = grad_norm_squared_local(params, tp_rank)
    if model_parallel_group is not None and model_parallel_group.size() > 1:
        dist.all_reduce(norm_sq, group=model_parallel_group)
    norm = math.sqrt(float(norm_sq))
    if max_norm and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
