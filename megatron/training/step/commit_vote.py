"""Step 4 of the iteration (`settle.py` says why it is safe): the ack over the DP group, then the
exchange over the replica's group, each read on the host and checked for latched failures.

A rank whose ack failed still joins its replica's exchange, carrying ACK_FAILED, and then raises
its failure: the replica's other ranks, whose acks completed, would otherwise wait in the
exchange for a rank that has gone to settle the round, until their operation timed out and the
settle gave up on them (with PP > 1 a kill before one stage's ack fenced every survivor). An
exchange that carries ACK_FAILED raises on every rank of the replica, so an exchange that
returns still means that every rank of the replica completed its ack."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training.initialize import ParallelGroups
from recover_patches.collectives import PeerFailure, Probe

ACK_FAILED = 2  # above the news flag (0 or 1): the exchange's MAX carries it


def confirm(groups: ParallelGroups, device, probe: Probe, news: bool,
            epoch: int) -> bool:
    """The round's vote: True if some rank saw a newer membership epoch (news). PeerFailure if
    this rank's ack or exchange failed, or a rank of its replica failed its ack."""
    flag = torch.tensor([int(news)], dtype=torch.int32, device=device)
    vote, failed = int(news), None  # type: int, PeerFailure | None
    for phase, group in (("ack", groups.dp), ("exchange", groups.replica)):
        probe.at(phase)
        if group.size() == 1:
            continue
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            vote = int(flag.item())  # on the host (NCCL: the wait), then the latched failures
            groups.raise_latched()
        except PeerFailure as err:
            if phase == "exchange":
                raise failed or err
            failed = err  # (an aborted operation may have written the flag: a fresh one)
            flag = torch.tensor([ACK_FAILED], dtype=torch.int32, device=device)
            vote = ACK_FAILED
    if failed is not None:
        raise failed
    if vote == ACK_FAILED:
        raise PeerFailure(epoch, (), "commit.exchange", "a rank of this replica failed its ack",
                          confirmed=False)
    probe.at("confirmed")
    return bool(vote)
