"""The distributed optimizer's norms from its shards: each rank measures its own pieces, and an
instance sums the measures in shard order, so every instance computes the same bits (their
replicas must take the same step)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def squares(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The pieces' squared L2 norm, in float64."""
    local = torch.zeros(1, dtype=torch.float64, device=device)
    if pieces:
        local += torch.stack(torch._foreach_norm(pieces, 2.0)).double().pow(2).sum()
    return local


def zeros(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The pieces' zero entries (integers: any order sums them exactly)."""
    return torch.tensor([float(sum(int((g == 0).sum()) for g in pieces))], dtype=torch.float64,
                        device=device)


def instance_sum(value: torch.Tensor, group) -> torch.Tensor:
    """`value` (one element) summed over `group` in rank order, not the collective's."""
    size = 1 if group is None else group.size()
    if size == 1:
        return value
    every = torch.empty(size, dtype=value.dtype, device=value.device)
    dist.all_gather_single(every, value, group=group)
    total = every[0].clone()
    for k in range(1, size):
        total += every[k]
    return total.reshape(1)
