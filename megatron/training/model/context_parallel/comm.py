"""transformer-engine's other two `cp_comm_type`s, in ReCoVer's own attention: "p2p" (its
and Megatron's default) and "a2a". Same inputs and result as `context_parallel_attention` (the
"allgather" kind): this CP rank's two chunks of queries, keys and values in Megatron's layout,
causal attention over the whole sequence; what differs is how the keys meet the queries.

p2p, a ring: the keys and values move CP - 1 times to the next rank of the CP group (their
gradients go back the other way in the backward pass), so every exchange is between neighbours,
as in transformer-engine; once all chunks arrived the rank attends as "allgather" does (one
masked flash-kernel call per query chunk). transformer-engine also overlaps each step's block with
the next exchange and keeps only two ranks' K/V at a time; here the autograd graph keeps every
arrived block, so memory is the all-gather's (measured: scripts/bench/cp_attention.py).

a2a (Ulysses): one all-to-all trades the sequence split for a head split (each rank gets the
whole sequence for heads/CP of the heads), plain causal attention runs on that, and a second
all-to-all trades back. It needs the heads (and the key/value heads) to divide by CP, as
transformer-engine does.

Both exchange through the group they are given (layer 1's fault-tolerant CP group in a job), so a
CP peer lost mid-exchange is a PeerFailure like any other.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training.model.context_parallel import (attend_chunks, cp_chunks,
                                                gathered_to_sequence_order)


# -- p2p: a ring ----------------------------------------------------------------------------------
def _shift(tensor: torch.Tensor, group: dist.ProcessGroup, forward: bool) -> torch.Tensor:
    """`tensor` to the next rank of the ring (the previous one if not `forward`); returns what
    arrives from the other side. Odd ranks receive first: no cycle of waiting senders."""
    size, rank = group.size(), group.rank()
    to, source = ((rank + 1) % size, (rank - 1) % size) if forward else \
        ((rank - 1) % size, (rank + 1) % size)
    tensor = tensor.contiguous()
    arriving = torch.empty_like(tensor)  # of the contiguous one: empty_like keeps strides
    if rank % 2:
        dist.recv(arriving, group_src=source, group=group)
        dist.send(tensor, group_dst=to, group=group)
    else:
        dist.send(tensor, group_dst=to, group=group)
        dist.recv(arriving, group_src=source, group=group)
    return arriving


class _RingShift(torch.autograd.Function):
    """Forward: the previous rank's tensor. Backward: the gradient goes back to that rank."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(tensor, group, forward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, forward=False), None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   group: dist.ProcessGroup, scale: float | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """`cp_comm_type` p2p. query, key, value: [2c, batch, heads, head_dim] (key and value may
    have fewer heads); returns [2c, batch, heads * head_dim]."""
    cp_size, cp_rank = group.size(), group.rank()
    kv = torch.stack([key, value])
    arrived: dict[int, torch.Tensor] = {}  # chunk of the sequence -> its [2, c, b, h, d] K/V
    for step in range(cp_size):
        if step:
            kv = _RingShift.apply(kv, group)
        owner = (cp_rank - step) % cp_size
        for chunk, piece in zip(cp_chunks(cp_size, owner), kv.chunk(2, dim=1)):
            arrived[chunk] = piece
    keys, values = torch.cat([arrived[c] for c in range(2 * cp_size)], dim=1).unbind(0)
    return attend_chunks(query, keys, values, cp_size, cp_rank, scale, dropout)


# -- a2a: sequence split <-> head split -----------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 to rank j, block i of the output from rank i. With equal blocks the
    exchange is its own inverse, so the backward pass sends the gradient the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)  # of the contiguous one: empty_like keeps a view's strides
    dist.all_to_all_single(out, tensor, group=group)
    return out


def _to_heads(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[2c, b, h, d] (this rank's chunks, all heads) -> [2Cc, b, h/C, d] (the whole sequence in
    order, this rank's share of the heads)."""
    cp_size = group.size()
    s, b, h, d = local.shape
    by_heads = local.reshape(s, b, cp_size, h // cp_size, d).permute(2, 0, 1, 3, 4)
    gathered = _AllToAll.apply(by_heads, group).reshape(cp_size * s, b, h // cp_size, d)
    chunks = gathered.chunk(2 * cp_size)
    return torch.cat([chunks[i] for i in gathered_to_sequence_order(cp_size)])


def _to_sequence(whole: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`_to_heads` backwards: [2Cc, b, h/C, d] -> [2c, b, h, d]."""
    cp_size = group.size()
    in_sequence = whole.chunk(2 * cp_size)
    placed: list[torch.Tensor] = [in_sequence[0]] * (2 * cp_size)
    for chunk, position in enumerate(gathered_to_sequence_order(cp_size)):
        placed[position] = in_sequence[chunk]
    s2, b, hc, d = whole.shape
    by_rank = torch.cat(placed).reshape(cp_size, s2 // cp_size, b, hc, d)
    mine = _AllToAll.apply(by_rank, group)  # [C (head share), 2c, b, h/C, d]
    return mine.permute(1, 2, 0, 3, 4).reshape(s2 // cp_size, b, cp_size * hc, d)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      group: dist.ProcessGroup, scale: float | None = None,
                      dropout: float = 0.0) -> torch.Tensor:
    """`cp_comm_type` a2a. query, key, value: [2c, batch, heads, head_dim]; the query and
    key/value heads divisible by CP (checked with the flags); returns [2c, batch, heads * dim]."""
    q, k, v = (_to_heads(t, group).permute(1, 2, 0, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    local = _to_sequence(out.permute(2, 0, 1, 3), group)
    return local.reshape(local.size(0), local.size(1), -1)
