"""Building the optimizer, its loss scaler, the gradient buffer's layout and the LR/WD scheduler
from the flags (Megatron's rules): the one place that picks which optimizer runs."""
from __future__ import annotations

from typing import Sequence

import torch
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.distributed_optimizer import ShardedAdamW
from megatron.training.optimizer import LossScaler, MainParamsAdamW, Optimizer
from recover_patches.recovery.grad_buffer import FlatLayout, flat_layout


def build_loss_scaler(args) -> LossScaler | None:
    if not args.fp16:
        return None  # bf16 and fp32 need no scaling
    if args.loss_scale is not None:
        return LossScaler(args.loss_scale, dynamic=False)
    return LossScaler(args.initial_loss_scale, dynamic=True, min_scale=args.min_loss_scale,
                      window=args.loss_scale_window, hysteresis=args.hysteresis)


def build_optimizer(model: torch.nn.Module, args, groups) -> Optimizer:
    """Weight decay is skipped for biases and 1-D parameters (megatron-core's standard groups).
    Note: `_get_param_groups` agrees on group keys with an all_gather_object on the default group,
    so every rank must call this at start-up (bootstrap, before any failure can matter)."""
    config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                             weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                             adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             clip_grad=args.clip_grad)
    param_groups = _get_param_groups([model], config, None)
    hyper = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                 weight_decay=args.weight_decay, scaler=build_loss_scaler(args))
    layout = flat_layout_for(args, groups, [p for g in param_groups for p in g["params"]])
    if not args.use_distributed_optimizer:
        return MainParamsAdamW(param_groups, layout=layout, **hyper)
    size = groups.topology.dp // args.num_distributed_optimizer_instances
    return ShardedAdamW(param_groups, layout=layout, shard=groups.coord.replica % size,
                        shards=size, instance_group=groups.instance, **hyper)


def flat_layout_for(args, groups, params: Sequence[torch.Tensor]) -> FlatLayout:
    """The gradient buffer's layout (the distributed optimizer shards the same one). Megatron's
    bucket rule: one bucket unless overlapping; then --ddp-bucket-size, default max(40M, 1M x DP)
    parameters. With the distributed optimizer each bucket is padded to a multiple of the instance
    size, and the tied embedding gets a bucket of its own: both pipeline ends then shard it alike,
    so its gradients can be summed range by range."""
    bucket = args.ddp_bucket_size
    if bucket is None and args.overlap_grad_reduce:
        bucket = max(40_000_000, 1_000_000 * groups.topology.dp)
    if not args.use_distributed_optimizer:
        return flat_layout(params, bucket)
    return flat_layout(params, bucket, pad_to=groups.per_instance,
                       alone=lambda p: getattr(p, "tied_embedding_copy", False))


def build_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Megatron steps the scheduler in samples: one iteration advances it by the global batch.
    On a resume megatron-core's scheduler checks the schedule against the checkpoint's: equal
    values or an AssertionError, unless --use-checkpoint-opt_param-scheduler (take the
    checkpoint's) or --override-opt_param-scheduler (take these)."""
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
        wd_incr_steps=int(wd_incr_steps), wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
