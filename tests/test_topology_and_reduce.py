from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recover_patches.pipeline.loss import masked_loss_sum, vocab_parallel_cross_entropy
from recover_patches.recovery.reduce import CommitError, Totals, check_commit
from recover_patches.pipeline.sampler import MicrobatchSampler, first_microbatch_id
from recover_patches.topology import Topology


def test_megatron_rank_order_and_groups():
    t = Topology(tp=2, pp=2, dp=2)
    assert [t.coord(r)[:3] for r in (0, 1, 2, 5)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 0, 1)]
    assert all(t.rank(*t.coord(r)) == r for r in range(8))
    assert t.replica_ranks(1) == [2, 3, 6, 7]
    assert t.tp_ranks(0, 1) == [4, 5] and t.pp_ranks(1, 0) == [1, 5]
    assert t.dp_ranks(0, 0) == [0, 2] and t.dp_ranks(1, 1, replicas=[1]) == [7]
    assert t.embedding_ranks(0, 1) == [2, 6]
    # every rank is in exactly one replica; DP groups take one rank per replica
    assert sorted(r for k in range(2) for r in t.replica_ranks(k)) == list(range(8))
    with pytest.raises(ValueError):
        Topology.from_world(6, 2, 2)


def test_tp_pp_dp_mapping_keeps_each_replica_contiguous():
    t = Topology.from_world(8, 2, 2, dp_last=True)  # --use-tp-pp-dp-mapping
    assert [t.coord(r)[:3] for r in (0, 1, 2, 5)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 1, 0)]
    assert all(t.rank(*t.coord(r)) == r for r in range(8))
    assert t.replica_ranks(0) == [0, 1, 2, 3] and t.replica_ranks(1) == [4, 5, 6, 7]
    assert t.tp_ranks(1, 1) == [6, 7] and t.pp_ranks(0, 1) == [4, 6]
    assert t.dp_ranks(1, 0) == [1, 5] and t.embedding_ranks(0, 0) == [0, 2]


@pytest.mark.parametrize("dp_last", [False, True])
@pytest.mark.parametrize("tp, cp, pp, dp", [(1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (2, 4, 2, 1),
                                            (2, 2, 2, 3)])
def test_context_parallel_ranks_follow_megatrons_rank_generator(tp, cp, pp, dp, dp_last):
    """Every group is the one megatron-core's RankGenerator makes for Megatron's order
    (`tp-cp-ep-dp-pp`, or `tp-cp-ep-pp-dp` with --use-tp-pp-dp-mapping)."""
    from megatron.core.parallel_state import RankGenerator
    t = Topology.from_world(tp * cp * pp * dp, tp, pp, dp_last=dp_last, cp=cp)
    megatron = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp,
                             order="tp-cp-ep-pp-dp" if dp_last else "tp-cp-ep-dp-pp")

    def groups(name: str) -> set[tuple[int, ...]]:
        return {tuple(sorted(g)) for g in megatron.get_ranks(name)}
    coords = [t.coord(r) for r in range(t.world_size)]
    assert all(t.rank(*c) == r for r, c in enumerate(coords))
    assert {tuple(t.tp_ranks(c.replica, c.pp, c.cp)) for c in coords} == groups("tp")
    assert {tuple(t.cp_ranks(c.tp, c.replica, c.pp)) for c in coords} == groups("cp")
    assert {tuple(t.pp_ranks(c.tp, c.replica, c.cp)) for c in coords} == groups("pp")
    assert {tuple(t.dp_ranks(c.tp, c.pp, cp=c.cp)) for c in coords} == groups("dp")
    # a replica is every rank with its dp index: megatron's tp-cp-pp group
    assert {tuple(sorted(t.replica_ranks(k))) for k in range(dp)} == groups("tp-cp-pp")


def test_sampler_addresses_samples_by_global_id():
    data = [{"tokens": [i, i], "labels": [i, i], "loss_mask": [1.0, 0.0], "position_ids": [0, 1]}
            for i in range(10)]
    sampler = MicrobatchSampler(data, micro_batch_size=3)
    assert sampler(2)["tokens"][:, 0].tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        sampler(3)
    assert first_microbatch_id(12, 3) == 4


def test_commit_check_needs_exactly_the_planned_ids():
    ids = list(range(8, 16))
    check_commit(Totals.of_ids(ids[:3]) + Totals.of_ids(ids[3:]), ids)
    for wrong in (ids[:-1], ids + [16], ids[:-1] + [7], ids[:4] + ids[:4]):
        with pytest.raises(CommitError):
            check_commit(Totals.of_ids(wrong), ids)


def test_cross_entropy_matches_torch_on_one_shard():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5)
    mask[0, 0] = 0
    ours = masked_loss_sum(vocab_parallel_cross_entropy(logits, target, None), mask)
    ref = (F.cross_entropy(logits.detach().requires_grad_().view(-1, 11), target.view(-1),
                           reduction="none") * mask.view(-1)).sum()
    assert float(ours) == pytest.approx(float(ref), rel=1e-6)
    (grad,) = torch.autograd.grad(ours, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = (F.cross_entropy(ref_logits.view(-1, 11), target.view(-1), reduction="none")
           * mask.view(-1)).sum()
    ref.backward()
    assert torch.allclose(grad, ref_logits.grad, atol=1e-6)
