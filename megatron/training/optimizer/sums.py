"""Norms from pieces spread over ranks. The distributed optimizer's: each rank measures its own
pieces, and an instance sums the measures in shard order, so every instance computes the same
bits (their replicas must take the same step). --recover-exact-reduction's (`fixed_point_norm`):
the same bits for any split of the elements over ranks (any DP size, any live replicas)."""
from __future__ import annotations

import math
from typing import Any, Sequence

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


_FRACTION_BITS = 21  # per limb: 2^42 squares of at most 2^21 each sum below 2^63


def fixed_point_norm(parts: Sequence[tuple[list[torch.Tensor], Any, bool]], outer,
                     device: torch.device) -> float:
    """--recover-exact-reduction: the L2 norm of every `parts` piece, the same bits however the
    elements are split over ranks. Each part is (pieces, the group whose members hold the rest
    of it, whether this rank counts it -- the sum over the group is taken either way, every
    member must call). The largest |x| is agreed first (a MAX: exact); then each (x / peak)^2 is
    cut into two 21-bit fixed-point limbs, whose integer sums are exact in any order; the sums
    meet over each part's group, then over `outer`, and the norm is built once from them."""
    peak = torch.zeros(1, dtype=torch.float64, device=device)
    for pieces, _, _ in parts:
        for x in pieces:
            if x.numel():
                largest = torch.nan_to_num(x.detach().abs().max().double(), nan=math.inf,
                                          posinf=math.inf)
                torch.maximum(peak, largest.reshape(1), out=peak)
    for group in [*{id(g): g for _, g, _ in parts if g is not None}.values(), outer]:
        if group is not None and group.size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    top = float(peak)
    if top == 0.0 or not math.isfinite(top):
        return top
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for pieces, group, counted in parts:
        part = torch.zeros(2, dtype=torch.int64, device=device)
        for x in pieces:
            scaled = (x.detach().double() / top).square_().mul_(2.0 ** _FRACTION_BITS)
            whole = scaled.floor()
            part[0] += whole.long().sum()
            part[1] += scaled.sub_(whole).mul_(2.0 ** _FRACTION_BITS).round_().long().sum()
        if group is not None and group.size() > 1:
            dist.all_reduce(part, group=group)
        if counted:
            total += part
    if outer is not None and outer.size() > 1:
        dist.all_reduce(total, group=outer)
    upper, lower = (int(v) for v in total.tolist())  # (Python ints: exact)
    return top * math.sqrt(((upper << _FRACTION_BITS) + lower) * 2.0 ** (-2 * _FRACTION_BITS))
