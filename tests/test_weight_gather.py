"""The distributed optimizer's weight all-gathers (`megatron/training/optimizer/distributed/weight_gather.py`)."""
from __future__ import annotations

import torch

from megatron.training.optimizer.distributed.weight_gather import WeightGather
from recover_patches.recovery.grad_buffer import flat_layout


class TwoMembers:
    """This rank is member 1 of a two-member instance."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


class StreamWait:
    def wait(self) -> bool:
        return True  # NCCL: the stream waits, the host goes on


class AbortedGather(WeightGather):
    """An all-gather whose communicator was aborted: its wait returned (on NCCL the stream
    waited, then the abort released it) and its output holds nothing that was sent."""

    @staticmethod
    def all_gather(mine, group, async_op=False):
        return StreamWait(), torch.full((group.size() * mine.numel(),), float("nan"))


def test_an_aborted_gather_leaves_this_ranks_own_range_as_it_sent_it():
    """Found under the emulated NCCL with --num-distributed-optimizer-instances 2, a rank killed
    in the weight all-gather: with fp32 weights the own range is the optimizer's only copy of
    its main params, the aborted gather overwrote it, and the recovery re-sharded from it (a
    survivor's weights summed to 2.2 where the others' summed to 579). The other members'
    ranges are what the recovery fetches again."""
    params = [torch.zeros(3), torch.zeros(5)]
    layout = flat_layout(params, pad_to=2)
    gather = AbortedGather(params, layout)
    (start, end), = layout.buckets
    half = (end - start) // 2
    own = torch.arange(half, dtype=torch.float32) + 1  # member 1 holds the second half
    gather.after_step([own], [TwoMembers()])
    flat = torch.cat([p.view(-1) for p in reversed(params)])  # the layout's order
    assert torch.equal(flat[half:], own)
    assert torch.isnan(flat[:half]).all()  # the other member's range: not gathered
