"""Context parallelism's CPU attention (`megatron/training/model/context_parallel/__init__.py`,
`model/context_parallel/comm.py`) against full causal attention of one process: Megatron's chunking
(rank r holds chunks r and 2C-1-r), and each `cp_comm_type`: the K/V all-gather and its
gradient's reduce-scatter, the p2p ring, the a2a head exchange, at CP 2 and CP 4 (a2a: CP 2) in
one gloo job of 4 ranks,
fp32, with grouped-query attention. Outputs and the gradients of queries, keys and values must
equal the full attention's, sliced the same way, to fp32 round-off."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training.model.context_parallel import (context_parallel_attention, cp_chunks,
                                                split_for_cp_rank)
from megatron.training.model.context_parallel.comm import ring_attention, ulysses_attention
from tests.gloo_ranks import run_ranks

SEQ, BATCH, HEADS, KV_HEADS, DIM = 16, 2, 4, 2, 8


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert [cp_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    tokens = torch.arange(8)[None, :]  # [batch, seq]
    assert split_for_cp_rank(tokens, 1, 2, 0).tolist() == [[0, 1, 6, 7]]
    assert split_for_cp_rank(tokens, 1, 2, 1).tolist() == [[2, 3, 4, 5]]
    assert split_for_cp_rank(tokens, 1, 1, 0) is tokens
    with pytest.raises(ValueError, match="multiple of 2 x --context-parallel-size"):
        split_for_cp_rank(tokens, 1, 3, 0)


def _full_attention(q, k, v):
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                         is_causal=True, enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)


def _compare_rank(rank: int) -> None:
    torch.manual_seed(0)  # the same whole-sequence inputs on every rank
    q = torch.randn(SEQ, BATCH, HEADS, DIM, requires_grad=True)
    k, v = (torch.randn(SEQ, BATCH, KV_HEADS, DIM, requires_grad=True) for _ in range(2))
    weight = torch.randn(SEQ, BATCH, HEADS * DIM)  # a loss that weighs every output differently
    expected = _full_attention(q, k, v)
    (expected * weight).sum().backward()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    # a2a splits the K/V heads over CP: CP 2 only (2 K/V heads)
    for kind, attention, cp_size in (("allgather", context_parallel_attention, 2),
                                     ("allgather", context_parallel_attention, 4),
                                     ("p2p", ring_attention, 2), ("p2p", ring_attention, 4),
                                     ("a2a", ulysses_attention, 2)):
        group = halves[rank // 2] if cp_size == 2 else dist.group.WORLD
        cp_rank = dist.get_rank(group)

        def mine(t: torch.Tensor) -> torch.Tensor:
            return split_for_cp_rank(t, 0, cp_size, cp_rank)
        local = [mine(t.detach()).requires_grad_() for t in (q, k, v)]
        out = attention(*local, group=group)
        (out * mine(weight)).sum().backward()
        where = f"{kind} at CP {cp_size}"
        torch.testing.assert_close(out, mine(expected.detach()), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, w=where: f"output, {w}: {m}")
        for name, full, part in zip("qkv", (q, k, v), local):
            assert part.grad is not None, name
            torch.testing.assert_close(part.grad, mine(full.grad), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, w=where: f"d{n}, {w}: {m}")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_cp2_and_cp4_match_full_attention_forward_and_backward():
    assert run_ranks(_compare_rank, 4) == []
