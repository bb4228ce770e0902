"""--dist-ckpt-optim-fully-reshardable: the optimizer in Megatron's `fully_reshardable` layout.

Megatron-LM's DistributedOptimizer writes, with that flag (megatron-core's
`sharded_param_state_fully_reshardable`), one entry per model parameter under "param_state":
its fp32 main param and Adam's moments, each a ShardedTensor with the weight's own key, shape and
sharding under `optimizer.state.{param,exp_avg,exp_avg_sq}.`; the param groups (each with Adam's
step) and the loss scaler under "optimizer"/"grad_scaler" in common.pt; and common.pt's
`content_metadata` names the layout. Megatron loads that at any TP / PP / DP and so does ReCoVer.

ReCoVer's optimizers hold an unsharded dict at save time (the distributed optimizer gathers its
shards for the writing replica), so this is a change of keys, not of data: `fully_reshardable`
turns that dict into the layout, `unsharded` turns a loaded layout back.
"""
from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

SHARDING_TYPE = "distrib_optim_sharding_type"
FULLY_RESHARDABLE = "fully_reshardable"
CONTENT_METADATA = "content_metadata"  # megatron-core's key in common.pt (serialization.py)
_MOMENTS = ("exp_avg", "exp_avg_sq")


def content_metadata() -> dict:
    """What Megatron-LM records for a fully_reshardable save (its dp_cp_group is not saved)."""
    return {SHARDING_TYPE: FULLY_RESHARDABLE,
            "distrib_optim_fully_reshardable_mem_efficient": False,
            "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def is_fully_reshardable(common: dict) -> bool:
    """Whether a checkpoint's common.pt says its optimizer is in this layout."""
    return (common.get(CONTENT_METADATA) or {}).get(SHARDING_TYPE) == FULLY_RESHARDABLE


def _step_of(state: dict) -> float | None:
    steps = {float(s["step"]) for s in state.values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"Adam's step differs between parameters: {sorted(steps)}")
    return steps.pop() if steps else None


def fully_reshardable(optimizer_state: dict, sharded_params: dict, params: list,
                      loading: bool = False) -> dict:
    """`optimizer_state` (our optimizers' unsharded dict, indexed like `params`) in Megatron's
    layout; `sharded_params`: parameter index -> the model's ShardedTensor of that weight.
    `loading`: a template to load into (every main param a fresh tensor, read and then dropped
    where the weight is fp32)."""
    inner = optimizer_state["optimizer"]
    step = _step_of(inner["state"])
    halves = iter(optimizer_state["fp32_from_fp16_params"])
    param_state = {}
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            main = next(halves)
        elif loading:
            main = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        else:  # an fp32 run's main params are the weights themselves
            main = p.detach()
        tensors = {"param": main}
        tensors.update({n: t for n, t in inner["state"].get(i, {}).items() if n in _MOMENTS})
        param_state[i] = {name: make_sharded_optimizer_tensor(sharded_params[i], t,
                                                              prefix=f"optimizer.state.{name}")
                          for name, t in tensors.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               **({} if step is None else {"step": step})} for g in inner["param_groups"]]
    layout = {k: v for k, v in optimizer_state.items()
              if k not in ("optimizer", "fp32_from_fp16_params")}
    layout["optimizer"] = {**{k: v for k, v in inner.items() if k != "state"},
                           "param_groups": groups}
    layout["param_state"] = param_state
    return layout


def unsharded(loaded: dict, params: list, group_sizes: list[int]) -> dict:
    """A loaded fully_reshardable optimizer back in our optimizers' unsharded dict."""
    param_state = loaded["param_state"]
    groups, index = [], 0
    step = None
    for hyper, size in zip(loaded["optimizer"]["param_groups"], group_sizes):
        step = hyper.get("step", step)
        groups.append({**{k: v for k, v in hyper.items() if k != "step"},
                       "params": list(range(index, index + size))})
        index += size
    state = {i: {"step": torch.tensor(float(step or 0)),
                 **{n: param_state[i][n] for n in _MOMENTS}}
             for i in range(len(params)) if all(n in param_state[i] for n in _MOMENTS)}
    out = {k: v for k, v in loaded.items() if k not in ("optimizer", "param_state")}
    out["optimizer"] = {**{k: v for k, v in loaded["optimizer"].items() if k != "param_groups"},
                        "state": state, "param_groups": groups}
    out["fp32_from_fp16_params"] = [param_state[i]["param"] for i, p in enumerate(params)
                                    if p.dtype != torch.float32]
    return out
