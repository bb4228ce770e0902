"""transformer-engine's other two `cp_comm_type`s, in ReCoVer's own attention ([O]): "p2p" (its
and Megatron's default) and "a2a". Same inputs and result as `context_parallel_attention` (the
"allgather" kind): this CP rank's two chunks of queries, keys and values in Megatron's layout,
causal attention over the whole sequence; what differs is how the keys meet the queries.

p2p, a ring: the keys and values move CP - 1 times to the next rank of the CP group (and their
gradients back the other way in the backward pass), so a rank holds two ranks' K/V at a time,
never the whole sequence's. Each step attends this rank's query chunks to the arriving chunks:
a key chunk after a query chunk is skipped (all masked), the same chunk is causal, an earlier one
is whole. The partial results are merged by their log-sum-exp at the end, which is softmax over
all keys exactly (in fp32 here; transformer-engine does the same in its kernels).

a2a (Ulysses): one all-to-all trades the sequence split for a head split (each rank gets the
whole sequence for heads/CP of the heads), plain causal attention runs on that, and a second
all-to-all trades back. It needs the heads (and the key/value heads) to divide by CP, as
transformer-engine does.

Both exchange through the group they are given (layer 1's fault-tolerant CP group in a job), so a
CP peer lost mid-exchange is a PeerFailure like any other.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training.context_parallel import cp_chunks, gathered_to_sequence_order


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


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           dropout: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk against one key chunk ([batch, heads, c, dim]): the softmax-normalised
    output of this block alone and its log-sum-exp per query (fp32)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        c = scores.size(-1)
        allowed = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    if dropout > 0:
        weights = F.dropout(weights, dropout)
    return torch.matmul(weights, v.float()), lse


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   group: dist.ProcessGroup, scale: float | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """`cp_comm_type` p2p. query, key, value: [2c, batch, heads, head_dim] (key and value may
    have fewer heads); returns [2c, batch, heads * head_dim]."""
    cp_size, cp_rank = group.size(), group.rank()
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    repeat = query.size(2) // key.size(2)  # grouped-query attention: K/V heads serve several
    mine = cp_chunks(cp_size, cp_rank)
    queries = [t.permute(1, 2, 0, 3) for t in query.chunk(2)]  # [batch, heads, c, dim]
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    kv = torch.stack([key, value])
    for step in range(cp_size):
        if step:
            kv = _RingShift.apply(kv, group)
        theirs = cp_chunks(cp_size, (cp_rank - step) % cp_size)
        for k_chunk, k, v in zip(theirs, kv[0].chunk(2), kv[1].chunk(2)):
            k, v = (t.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3) for t in (k, v))
            for i, (q_chunk, q) in enumerate(zip(mine, queries)):
                if k_chunk <= q_chunk:  # later key chunks are all masked: not computed
                    parts[i].append(_block(q, k, v, scale, k_chunk == q_chunk, dropout))
    outputs = []
    for blocks in parts:
        lses = torch.stack([lse for _, lse in blocks])
        weights = torch.softmax(lses, dim=0).unsqueeze(-1)  # each block's share of the softmax
        merged = (weights * torch.stack([out for out, _ in blocks])).sum(0)
        outputs.append(merged.to(query.dtype).permute(2, 0, 1, 3))  # [c, batch, heads, dim]
    out = torch.cat(outputs)
    return out.reshape(out.size(0), out.size(1), -1)


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
