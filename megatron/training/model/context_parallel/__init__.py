"""Context parallelism's attention where transformer-engine does not run: on CPU, and on a
GPU without it. megatron-core's local layer spec refuses CP, so this is what lets a CP layout
train here.

Megatron's layout: a CP group of size C splits every sequence into 2C chunks of equal length and
CP rank r holds chunks r and 2C-1-r, in that order (under a causal mask the early chunks are
cheap and the late ones dear, so each rank gets one of each: `cp_chunks`, `split_for_cp_rank`).
Tokens, labels, the loss mask and position ids are sliced so before the model sees them.

Attention (`context_parallel_attention`): each rank all-gathers the keys and values of the whole
sequence over the CP group (one all-gather each, through whatever group it is given: layer 1's
fault-tolerant group in a job), puts the chunks in sequence order, and attends its two query
chunks to the keys at or before them (the causal mask in global positions). The backward pass
reduce-scatters the keys' and values' gradients back to the ranks that hold those chunks: every
rank's queries contributed to them. This is transformer-engine's `cp_comm_type` "allgather"; the
K/V of the whole sequence is held on every rank for the length of one layer's attention.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def cp_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp_size) CP rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp_rank(tensor: torch.Tensor, seq_dim: int, cp_size: int,
                      cp_rank: int) -> torch.Tensor:
    """This CP rank's part of a whole-sequence tensor: its two chunks along `seq_dim`, joined."""
    if cp_size == 1:
        return tensor
    length = tensor.size(seq_dim)
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {cp_size} "
                         "equal chunks: --seq-length must be a multiple of 2 x "
                         "--context-parallel-size")
    pieces = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([pieces[c] for c in cp_chunks(cp_size, cp_rank)], dim=seq_dim)


def gathered_to_sequence_order(cp_size: int) -> list[int]:
    """For each chunk of the sequence, in order, where it lies in the all-gather's output (rank
    r's two chunks are at 2r and 2r+1)."""
    where = {}
    for rank in range(cp_size):
        first, second = cp_chunks(cp_size, rank)
        where[first], where[second] = 2 * rank, 2 * rank + 1
    return [where[chunk] for chunk in range(2 * cp_size)]


class _GatherSequence(torch.autograd.Function):
    """[2c, ...] on each rank -> [2C * c, ...] in sequence order on every rank; backward: the
    gradient's sum over the ranks, each rank's own chunks scattered back to it."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        cp_size = dist.get_world_size(group)
        ctx.group, ctx.order = group, gathered_to_sequence_order(cp_size)
        gathered = local.new_empty((cp_size * local.size(0), *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=group)
        chunks = gathered.chunk(2 * cp_size)
        return torch.cat([chunks[i] for i in ctx.order])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp_size = dist.get_world_size(ctx.group)
        in_sequence = grad.chunk(2 * cp_size)
        placed: list[torch.Tensor | None] = [None] * (2 * cp_size)
        for chunk, position in enumerate(ctx.order):
            placed[position] = in_sequence[chunk]
        stacked = torch.cat(placed)  # type: ignore[arg-type]  # every position is filled
        local = grad.new_empty((grad.size(0) // cp_size, *grad.shape[1:]))
        dist.reduce_scatter_single(local, stacked.contiguous(), group=ctx.group)
        return local, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence (dim 0) from every CP rank's two chunks; differentiable."""
    return _GatherSequence.apply(local, group)


def _causal_mask(chunk: int, chunk_len: int, device: torch.device) -> torch.Tensor:
    """Which keys (all those up to the end of `chunk`) each query of `chunk` may see: True where
    the key's position is at or before the query's."""
    queries = chunk * chunk_len + torch.arange(chunk_len, device=device)
    keys = torch.arange((chunk + 1) * chunk_len, device=device)
    return keys[None, :] <= queries[:, None]


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               group: dist.ProcessGroup, scale: float | None = None,
                               dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence.

    query, key, value: [2c, batch, heads, head_dim] (megatron-core's layout; key and value may
    have fewer heads, grouped-query attention), this rank's two chunks (`split_for_cp_rank`).
    Returns [2c, batch, heads * head_dim], as megatron-core's core attention does."""
    keys, values = gather_sequence(key, group), gather_sequence(value, group)
    return attend_chunks(query, keys, values, dist.get_world_size(group), dist.get_rank(group),
                         scale, dropout)


def attend_chunks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cp_size: int,
                  cp_rank: int, scale: float | None, dropout: float) -> torch.Tensor:
    """This rank's two query chunks ([2c, batch, heads, dim]) attending causally to the whole
    sequence's keys and values ([2Cc, batch, kv heads, dim], in sequence order); returns
    [2c, batch, heads * dim]."""
    chunk_len = query.size(0) // 2
    outputs = []
    for local, chunk in zip(query.chunk(2), cp_chunks(cp_size, cp_rank)):
        visible = (chunk + 1) * chunk_len  # keys after this chunk are masked anyway: not computed
        q, k, v = (t.permute(1, 2, 0, 3) for t in (local, keys[:visible], values[:visible]))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=_causal_mask(chunk, chunk_len, query.device), dropout_p=dropout,
            scale=scale, enable_gqa=q.size(1) != k.size(1))
        outputs.append(out.permute(2, 0, 1, 3))  # [c, batch, heads, head_dim]
    out = torch.cat(outputs)
    return out.reshape(out.size(0), out.size(1), -1)


def batch_for_cp_rank(batch: dict[str, torch.Tensor], cp_size: int,
                      cp_rank: int) -> dict[str, torch.Tensor]:
    """A microbatch's [batch, seq] tensors (tokens, labels, loss mask, position ids) cut to this
    CP rank's two chunks, as Megatron-LM's `get_batch_on_this_cp_rank` does."""
    return {key: split_for_cp_rank(value, 1, cp_size, cp_rank) for key, value in batch.items()}


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int,
                            cp_group: dist.ProcessGroup) -> torch.Tensor:
    """megatron-core's `get_pos_emb_on_this_cp_rank` (the rope table cut to this rank's chunks),
    without its `.cuda()` of the index, which a CPU-only build cannot do: the same chunks."""
    return split_for_cp_rank(pos_emb, seq_dim, cp_group.size(), cp_group.rank())
