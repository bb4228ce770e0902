"""Who writes a torch_dist save, and how the writers exchange its plan and results.

Replicas hold identical state, so the items of one position (a (tp, pp) coordinate) can be
written by any of its live replicas, and by any of a replica's CP ranks at that position (context
parallelism splits the sequence, not the weights). By default, as in Megatron-LM (--ckpt-fully-parallel-save is
its default; --no-ckpt-fully-parallel-save turns it off), the live replicas share the writing:
each item of a position goes to one of them, the largest first to the least loaded, a choice
every rank makes alike without communicating. With --no-ckpt-fully-parallel-save the lowest live
replica writes everything. Either way a writer that dies mid-save abandons that save: the
survivors' exchange fails, `latest` stays on the last complete checkpoint.

The exchange (DCP's local plans, then the write results) runs over groups the trainer already
has, so a save needs no communicator of its own: over the DP group (one position's holders: DP
x CP ranks), then over the positions of this rank's replica at its CP index (the replica itself
without CP): every writer ends with every writer's part, in one order on all of them.

With expert parallelism a position's replicas hold different experts: an expert item
(megatron-core's `.mlp.experts.` keys, one shard per local expert) is shared out among the
replicas holding the same experts (the expert-data-parallel group), the others as before.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor

from recover_patches.topology import Topology

# a ShardedObject (RNG state, ...) is small; a nominal size spreads several of them out
_OBJECT_BYTES = 1024
EXPERT_ITEM = ".mlp.experts."  # routed experts' keys (shared experts: `.mlp.shared_experts.`)


@dataclass(frozen=True)
class Writers:
    """This rank's part in a torch_dist save."""
    replica: dist.ProcessGroup  # the positions: TP x PP ranks of this replica at this CP index
    sharing: dist.ProcessGroup | None  # this position's holders (DP x CP); None: one writes
    is_coordinator: bool  # writes DCP's `.metadata`: the save's leader, which then commits
    device: torch.device  # where the exchange's collectives run (the model's device)
    expert_sharing: dist.ProcessGroup | None = None  # EP > 1: the holders of these experts

    @property
    def ranks(self) -> tuple[tuple[int, ...], ...]:
        """Who writes with this rank: a change (a replica lost) plans the save again."""
        groups = [self.replica, self.sharing, self.expert_sharing]
        return tuple(tuple(dist.get_process_group_ranks(g)) for g in groups if g is not None)

    def share(self, items: dict[str, list]) -> dict[str, list]:
        """The items (sharded key -> its shards on this rank) this rank writes."""
        if self.sharing is None:
            return items
        by_group = {self.sharing: [k for k in items if self.expert_sharing is None
                                   or EXPERT_ITEM not in k]}
        if self.expert_sharing is not None:
            by_group[self.expert_sharing] = [k for k in items if EXPERT_ITEM in k]
        mine = [key for group, keys in by_group.items() for key in assign_items(
            {k: items[k] for k in keys}, group.size())[dist.get_rank(group)]]
        return {key: items[key] for key in mine}

    def all_gather(self, obj) -> list:
        """Every writer's `obj`, in one order on all writers (`index` is this rank's place)."""
        if self.sharing is None:
            return gather_object(obj, self.replica, self.device)
        by_position = gather_object(gather_object(obj, self.sharing, self.device), self.replica,
                                    self.device)
        return [part for position in by_position for part in position]

    @property
    def index(self) -> int:
        if self.sharing is None:
            return dist.get_rank(self.replica)
        return dist.get_rank(self.replica) * self.sharing.size() + dist.get_rank(self.sharing)


def item_bytes(shards: list) -> int:
    return sum(s.data.numel() * s.data.element_size() if isinstance(s, ShardedTensor)
               else _OBJECT_BYTES for s in shards)


def assign_items(items: dict[str, list], writers: int) -> list[list[str]]:
    """The keys each of `writers` writes: largest first, each to the least loaded writer (the
    lowest on a tie). Deterministic in the keys and sizes, which every replica of a position has
    alike, so each computes the whole assignment and keeps its own part."""
    loads = [0] * writers
    assigned: list[list[str]] = [[] for _ in range(writers)]
    for key in sorted(items, key=lambda k: (-item_bytes(items[k]), k)):
        writer = loads.index(min(loads))
        loads[writer] += item_bytes(items[key])
        assigned[writer].append(key)
    return assigned


def gather_object(obj, group: dist.ProcessGroup, device: torch.device) -> list:
    """Every member's `obj`, in group-rank order, through all-reduces on `device`: torch's
    all_gather_object sends CPU tensors to a layer-1 group that runs NCCL (it cannot tell), and
    NCCL's list all-gather through that group came back without a work on an H100; the
    all-reduce is the operation the trainer already runs every step."""
    me, n = dist.get_rank(group), group.size()
    if n == 1:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    sizes[me] = payload.numel()
    dist.all_reduce(sizes, group=group)
    sizes_list = sizes.tolist()
    slots = torch.zeros(n, max(sizes_list), dtype=torch.uint8, device=device)
    slots[me, :payload.numel()] = payload.to(device)
    dist.all_reduce(slots, group=group)  # one non-zero slot per rank: the sum is a gather
    rows = slots.cpu()
    return [pickle.loads(rows[i, :size].numpy().tobytes()) for i, size in enumerate(sizes_list)]


def writer_rank(topology: Topology, live_replicas: list[int], tp: int, pp: int) -> int:
    """Deterministic: every rank agrees without communication on who writes (tp, pp) (its CP
    index 0: the CP ranks of a position hold the same weights)."""
    return topology.rank(tp, min(live_replicas), pp)
