"""Building the optimizer, its loss scaler, the gradient buffer's layout and the LR/WD scheduler
from their typed configuration (Megatron's rules): the one place that picks which optimizer runs."""
from __future__ import annotations

from typing import Sequence

import torch
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from megatron.training.config import OptimizerSetup, ScheduleConfig
from megatron.training.optimizer.distributed import ShardedAdamW
from megatron.training.optimizer.distributed.sharded_parameters import ShardingRules, shard_units
from megatron.training.optimizer import LossScaler, MainParamsAdamW, Optimizer
from recover_patches.recovery.grad_buffer import FlatLayout, flat_layout


def build_loss_scaler(adam: OptimizerConfig) -> LossScaler | None:
    if not adam.fp16:
        return None  # bf16 and fp32 need no scaling
    if adam.loss_scale is not None:
        return LossScaler(adam.loss_scale, dynamic=False)
    return LossScaler(adam.initial_loss_scale, dynamic=True, min_scale=adam.min_loss_scale,
                      window=adam.loss_scale_window, hysteresis=adam.hysteresis)


def build_optimizer(model: torch.nn.Module, setup: OptimizerSetup, groups) -> Optimizer:
    """Weight decay is skipped for biases and 1-D parameters (megatron-core's standard groups).
    Note: `_get_param_groups` agrees on group keys with an all_gather_object on the default group,
    so every rank must call this at start-up (bootstrap, before any failure can matter)."""
    adam = setup.adam
    param_groups = groups_at_any_expert_parallelism(_get_param_groups([model], adam, None))
    hyper = dict(lr=adam.lr, betas=(adam.adam_beta1, adam.adam_beta2), eps=adam.adam_eps,
                 weight_decay=adam.weight_decay, scaler=build_loss_scaler(adam))
    params = [p for g in param_groups for p in g["params"]]
    rules, unit_of = None, None
    if groups.topology.fsdp > 1:  # Megatron-FSDP: a bucket per unit, in the model's order
        whole = read_outside_their_unit(model)
        rules = ShardingRules(keep_whole=whole.__contains__, is_layer=is_transformer_layer)
        held = set(params)  # (what is read outside its unit in a bucket of its own, kept whole)
        unit_of = {p: (u, p in whole) for u, (_, unit) in
                   enumerate(shard_units(model, is_transformer_layer)) for p in unit if p in held}
        params = list(unit_of)
    layout = flat_layout_for(setup, groups, params, unit_of)
    if not adam.use_distributed_optimizer:
        return MainParamsAdamW(param_groups, layout=layout, **hyper)
    dense, experts = groups.optimizer_sharding()
    return ShardedAdamW(param_groups, layout=layout, shard=dense.shard, shards=dense.shards,
                        instance_group=dense.instance, experts=experts, sharded=rules, **hyper)


def is_transformer_layer(module: torch.nn.Module) -> bool:
    """Megatron-FSDP's unit: a layer's parameters gather as one."""
    return isinstance(module, BaseTransformerLayer)


def read_outside_their_unit(model: torch.nn.Module) -> set[torch.Tensor]:
    """Parameters used outside their unit's forward (`shard_units`), which Megatron-FSDP's sharded
    parameters keep whole: the word embeddings' weight that the output layer reads too (both
    ends on one stage), and a bias that a linear layer outside the transformer layers returns
    for its caller to add (`skip_bias_add`)."""
    whole: set[torch.Tensor] = set()
    for module in model.modules():
        if getattr(module, "share_embeddings_and_output_weights", False) and \
                module.pre_process and module.post_process:
            whole.add(getattr(module, "shared_embedding_or_output_weight")())
    for module, params in shard_units(model, is_transformer_layer):
        bias = getattr(module, "bias", None)
        if getattr(module, "skip_bias_add", False) and bias is not None and \
                any(bias is p for p in params):
            whole.add(bias)
    return whole


def groups_at_any_expert_parallelism(param_groups: list[dict]) -> list[dict]:
    """megatron-core puts experts' weights in groups of their own at EP > 1
    (`is_expert_parallel`, read by Megatron's DDP and clipping, by nothing here: the gradient
    buffer tells experts by their own mark). Merged back, the groups are EP 1's, so a checkpoint's
    groups match at any EP (a save at EP 2 resumes at EP 1)."""
    merged: dict[tuple, dict] = {}
    for group in param_groups:
        key = tuple((k, repr(v)) for k, v in sorted(group.items())
                    if k not in ("params", "is_expert_parallel"))
        if key in merged:
            merged[key]["params"] = [*merged[key]["params"], *group["params"]]
        else:
            merged[key] = {**group, "params": list(group["params"]), "is_expert_parallel": False}
    return list(merged.values())


def flat_layout_for(setup: OptimizerSetup, groups, params: Sequence[torch.Tensor],
                    unit_of: dict[torch.Tensor, tuple[int, bool]] | None = None) -> FlatLayout:
    """The gradient buffer's layout (the distributed optimizer shards the same one). Megatron's
    bucket rule: one bucket unless overlapping; then --ddp-bucket-size, default max(40M, 1M x DP)
    parameters. With the distributed optimizer each bucket is padded to a multiple of the instance
    size, and the tied embedding gets a bucket of its own: both pipeline ends then shard it alike,
    so its gradients can be summed range by range. `unit_of` (Megatron-FSDP's sharded
    parameters: each one's unit, and whether it stays whole): a bucket per unit, which its
    forward gathers alone."""
    bucket = setup.bucket_size
    if bucket is None and setup.overlap_grad_reduce:
        bucket = max(40_000_000, 1_000_000 * groups.topology.dp)
    if not setup.adam.use_distributed_optimizer:
        return flat_layout(params, bucket)
    if unit_of is not None:
        return flat_layout(params, None, pad_to=groups.optimizer_shards, apart=unit_of.__getitem__)
    return flat_layout(params, bucket, pad_to=groups.optimizer_shards,
                       alone=lambda p: getattr(p, "tied_embedding_copy", False))


def build_scheduler(optimizer, schedule: ScheduleConfig) -> OptimizerParamScheduler:
    """Megatron steps the scheduler in samples: one iteration advances it by the global batch.
    On a resume megatron-core's scheduler checks the schedule against the checkpoint's: equal
    values or an AssertionError, unless --use-checkpoint-opt_param-scheduler (take the
    checkpoint's) or --override-opt_param-scheduler (take these)."""
    s = schedule
    return OptimizerParamScheduler(
        optimizer, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr,
        lr_warmup_steps=s.warmup_steps, lr_decay_steps=s.decay_steps,
        lr_decay_style=s.decay_style, start_wd=s.start_wd, end_wd=s.end_wd,
        wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.wd_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_scheduler,
        override_opt_param_scheduler=s.override_scheduler,
        wsd_decay_steps=s.wsd_decay_steps, lr_wsd_decay_style=s.wsd_decay_style)
