"""The persistent main-grad buffer: accumulation through hooks, the out-of-place reduction, the
commit bookkeeping carried exactly in its fp32 tail, and the overlapped start of buckets."""
from __future__ import annotations

import pytest
import torch

from recover_patches.recovery.grad_buffer import GradBuffer
from recover_patches.recovery.reduce import Totals


def model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(dtype)


def backward(net: torch.nn.Module, seed: int) -> None:
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(seed))
    net(x.to(next(net.parameters()).dtype)).float().pow(2).sum().backward()


def reference_grads(net: torch.nn.Module, seeds: list[int]) -> list[torch.Tensor]:
    for seed in seeds:
        backward(net, seed)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    return grads


def test_hooks_accumulate_into_fp32_main_grad_views():
    net = model()
    expected = reference_grads(net, [1, 2, 3])
    buf = GradBuffer(list(net.parameters()), replicas=1, dp_group=None)
    for seed in [1, 2, 3]:
        backward(net, seed)
    for p, want in zip(net.parameters(), expected):
        assert p.grad is None  # moved into the buffer
        assert p.main_grad.data_ptr() >= buf.local.data_ptr()  # a view, not a copy
        torch.testing.assert_close(p.main_grad, want)


def test_half_precision_grads_accumulate_in_fp32():
    net = model(torch.bfloat16)
    buf = GradBuffer(list(net.parameters()), replicas=1, dp_group=None)
    backward(net, 1)
    assert buf.local.dtype == torch.float32
    assert all(p.main_grad.dtype == torch.float32 and p.grad is None for p in net.parameters())
    assert float(buf.local.abs().sum()) > 0


def test_reduction_is_out_of_place_and_undo_restores():
    net = model()
    buf = GradBuffer(list(net.parameters()), replicas=2, dp_group=None)
    backward(net, 1)
    before = buf.local.clone()
    buf.reduce(Totals.of_ids([3], tokens=7, loss_sum=1.5), replica=0, time_wire=0.25)
    buf.reduced_grads.mul_(0)  # what the step does to the reduced grads never reaches `local`
    assert torch.equal(buf.local, before)
    saved = buf.snapshot()
    backward(net, 2)
    assert not torch.equal(buf.local, before)
    buf.restore(saved)
    assert torch.equal(buf.local, before)


def test_tail_carries_large_integers_exactly():
    net = model()
    buf = GradBuffer(list(net.parameters()), replicas=3, dp_group=None)
    ids = [2**33 + k for k in range(5)]  # id sums far beyond fp32's exact 2**24
    totals = Totals.of_ids(ids, tokens=123_456_789, loss_sum=12345.678901234)
    fingerprint = (1 << 64) - 12345  # the weight fingerprint: 64 bits, exactly
    out = buf.reduce(totals, replica=2, time_wire=0.125, weight_hash=fingerprint)
    assert (out.totals.microbatches, out.totals.tokens, out.totals.id_sum, out.totals.id_hash_sum) \
        == (5, 123_456_789, totals.id_sum, totals.id_hash_sum)
    assert out.totals.loss_sum == pytest.approx(12345.678901234, rel=1e-12)  # hi + lo parts
    assert out.replica_times == [0.0, 0.0, 0.125]
    assert out.replica_weight_hashes == [0, 0, fingerprint]


@pytest.mark.parametrize("bucket", [1, 20, 40])
def test_overlap_starts_buckets_only_when_final_and_gives_the_same_gradient(bucket):
    seeds = [1, 2, 3]
    plain_net, overlap_net = model(), model()
    plain = GradBuffer(list(plain_net.parameters()), replicas=1, dp_group=None, bucket_numel=bucket)
    overlap = GradBuffer(list(overlap_net.parameters()), replicas=1, dp_group=None,
                         bucket_numel=bucket, overlap=True)
    assert len(overlap.buckets) > 1
    for net, buf in ((plain_net, plain), (overlap_net, overlap)):
        for k, seed in enumerate(seeds):
            if k == len(seeds) - 1:
                buf.arm()
            backward(net, seed)
            if buf is overlap and k < len(seeds) - 1:
                assert not overlap._works  # nothing starts before the last microbatch
    # every bucket but the last (it waits for the totals) started during the last backward
    assert set(overlap._works) == set(range(len(overlap.buckets) - 1))
    totals = Totals.of_ids([0, 1, 2], tokens=3)
    plain.reduce(totals, 0, 1.0)
    overlap.reduce(totals, 0, 1.0)
    assert torch.equal(plain.reduced, overlap.reduced)


def test_poison_makes_the_gradient_overflow():
    net = model()
    buf = GradBuffer(list(net.parameters()), replicas=1, dp_group=None)
    backward(net, 1)
    buf.poison()
    backward(net, 2)
    buf.reduce(Totals.of_ids([0]), 0, 1.0)
    assert not bool(torch.isfinite(buf.reduced_grads).all())


class OutOfOrder(torch.nn.Module):
    """Registered in one order, used in the other: backward finishes the *first* bucket last."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.second = torch.nn.Linear(5, 3)
        self.first = torch.nn.Linear(6, 5)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class TwoRankGroup:
    def size(self) -> int:
        return 2


def test_buckets_start_in_the_same_order_on_every_rank(monkeypatch):
    """A rank that overlaps and a rank with no microbatch this round (it launches everything from
    reduce) must issue the bucket collectives in one order, or gloo/NCCL pair the wrong buckets."""
    import recover_patches.recovery.grad_buffer as grad_buffer

    issued: list[tuple[str, int]] = []

    def record(tensor, group=None, async_op=False):
        issued.append((rank, tensor.data_ptr()))
        return None

    monkeypatch.setattr(grad_buffer.dist, "all_reduce", record)
    orders = {}
    for rank, computes in (("overlapping", True), ("idle", False)):
        net = OutOfOrder()
        buf = GradBuffer(list(net.parameters()), replicas=2, dp_group=TwoRankGroup(),
                         bucket_numel=3, overlap=True)
        assert len(buf.buckets) >= 3
        if computes:
            buf.arm()
            net(torch.randn(2, 6)).sum().backward()
        buf.reduce(Totals.of_ids([0] if computes else []), 0, 1.0)
        base = buf.reduced.data_ptr()
        orders[rank] = [(ptr - base) // 4 for r, ptr in issued if r == rank]
    assert orders["overlapping"] == orders["idle"] == sorted(orders["idle"])


def test_layout_pads_buckets_and_gives_a_marked_parameter_its_own():
    from recover_patches.recovery.grad_buffer import flat_layout
    params = [torch.zeros(n) for n in (5, 7, 6, 3)]  # laid out in reverse: 3, 6, 7, 5
    layout = flat_layout(params, bucket_numel=8, pad_to=4, alone=lambda p: p is params[1])
    # [3 + 6 = 9 -> 12) [the 7 alone -> 8) [5 -> 8): every bucket a multiple of 4
    assert layout.buckets == [(0, 12), (12, 20), (20, 28)] and layout.numel == 28
    assert [layout.offsets[p] for p in params] == [20, 12, 3, 0]
    # the defaults: one bucket, no padding, the same reversed offsets
    plain = flat_layout(params)
    assert plain.buckets == [(0, 21)] and [plain.offsets[p] for p in params] == [16, 9, 3, 0]


def test_arming_for_several_backwards_starts_buckets_after_the_last_of_them():
    """The interleaved schedule arms before its first backward with one backward per microbatch
    left: no bucket may start until each of its parameters has had all of them."""
    plain_net, overlap_net = model(), model()
    plain = GradBuffer(list(plain_net.parameters()), replicas=1, dp_group=None, bucket_numel=20)
    overlap = GradBuffer(list(overlap_net.parameters()), replicas=1, dp_group=None,
                         bucket_numel=20, overlap=True)
    overlap.arm(3)
    for k, seed in enumerate([1, 2, 3]):
        backward(plain_net, seed)
        backward(overlap_net, seed)
        if k < 2:
            assert not overlap._works  # counted down, not yet final
    assert set(overlap._works) == set(range(len(overlap.buckets) - 1))
    totals = Totals.of_ids([0, 1, 2], tokens=3)
    plain.reduce(totals, 0, 1.0)
    overlap.reduce(totals, 0, 1.0)
    assert torch.equal(plain.reduced, overlap.reduced)
