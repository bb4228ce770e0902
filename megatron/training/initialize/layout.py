"""Which groups a rank is in, made in one global order (tp, pp, replica, embedding, dp, self, ...)
on every rank, so that no creation waits on a rank that waits on it."""
from __future__ import annotations

import torch.distributed as dist

from megatron.training.initialize.factories import GroupFactory
from megatron.training.initialize.groups import ParallelGroups
from recover_patches.pipeline.interleaved import Kind
from recover_patches.pipeline.p2p import Channel
from recover_patches.topology import Coord, Topology


def p2p_channels(topology: Topology, c: Coord, make_group: GroupFactory,
                 shared: dist.ProcessGroup | None = None) -> dict[tuple[Kind, bool], Channel]:
    """This rank's four p2p channels (forward and backward, sending and receiving), each a group
    of its two ranks, created in one order on every rank ((kind, sending stage): no rendezvous
    waits on a rank that waits on it). `shared`: the PP group for all four, told apart by tag --
    torch's own groups (no coordinator) name a group by its ranks, so two groups of the same two
    ranks would collide; gloo keeps that correct, NCCL would not (refused on a GPU)."""
    stages, by_stage = topology.pp, topology.pp_ranks(c.tp, c.replica, c.cp)
    at = f".cp{c.cp}" if topology.cp > 1 else ""  # each CP index has its own pipeline
    s = c.pp
    after, before = (s + 1) % stages, (s - 1) % stages  # wrapping: chunk c's last -> c+1's first
    mine = {(Kind.FORWARD, True): (s, after), (Kind.FORWARD, False): (before, s),
            (Kind.BACKWARD, True): (s, before), (Kind.BACKWARD, False): (after, s)}
    channels = {}
    for (kind, sends), (src, dst) in sorted(mine.items(), key=lambda e: (e[0][0].value, e[1][0])):
        peer = dst if sends else src
        if shared is not None:
            channels[(kind, sends)] = Channel(shared, peer, tag=int(kind is Kind.BACKWARD))
            continue
        members = sorted({by_stage[src], by_stage[dst]})
        group = make_group(f"p2p.replica{c.replica}.tp{c.tp}{at}.{kind.value}{src}to{dst}",
                           members)
        channels[(kind, sends)] = Channel(group, members.index(by_stage[peer]))
    return channels


def build_groups(topology: Topology, rank: int, make_group: GroupFactory,
                 optimizer_instances: int | None = None, channels: str | None = None,
                 resilient: bool = False) -> ParallelGroups:
    """optimizer_instances K (--use-distributed-optimizer): also the group of this rank's instance,
    DP / K consecutive replicas. channels (model chunks): "groups" for the p2p channel groups of
    `p2p_channels`, "shared" for channels over the PP group (torch's own groups). resilient:
    `make_group` makes ResilientGroups (`resilient_group_factory`)."""
    c = topology.coord(rank)
    at = f".cp{c.cp}" if topology.cp > 1 else ""  # one group of each per CP index
    tp = make_group(f"tp.replica{c.replica}.stage{c.pp}{at}",
                    topology.tp_ranks(c.replica, c.pp, c.cp))
    pp = make_group(f"pp.replica{c.replica}.tp{c.tp}{at}", topology.pp_ranks(c.tp, c.replica, c.cp))
    unit = c.replica // topology.unit_size  # expert parallelism or Megatron-FSDP: the unit
    replica = (make_group(f"replica{c.replica}", topology.replica_ranks(c.replica))
               if topology.unit_size == 1 else make_group(f"unit{unit}", topology.unit_ranks(c.replica)))
    embedding = None
    if topology.pp > 1 and c.pp in (0, topology.pp - 1):
        embedding = make_group(f"embd.replica{c.replica}.tp{c.tp}{at}",
                               topology.embedding_ranks(c.tp, c.replica, c.cp))
    dp = make_group(f"dp.tp{c.tp}.stage{c.pp}", topology.dp_cp_ranks(c.tp, c.pp))
    self_group = make_group(f"self.rank{rank}", [rank])
    context = model_parallel = None
    if topology.cp > 1:
        context = make_group(f"cp.replica{c.replica}.tp{c.tp}.stage{c.pp}",
                             topology.cp_ranks(c.tp, c.replica, c.pp))
        model_parallel = make_group(f"mp.replica{c.replica}{at}",
                                    [r for r in topology.replica_ranks(c.replica)
                                     if topology.coord(r).cp == c.cp])
    expert = tp_expert = expert_dp = alone = None
    if topology.unit_size > 1:
        alone = make_group(f"replica{c.replica}", topology.replica_ranks(c.replica))
    if topology.ep > 1:
        expert = make_group(f"ep.unit{unit}.tp{c.tp}.stage{c.pp}",
                            topology.ep_ranks(c.tp, c.replica, c.pp))
        tp_expert = expert if topology.tp == 1 else make_group(
            f"tpep.unit{unit}.stage{c.pp}", topology.tp_ep_ranks(c.replica, c.pp))
        expert_dp = make_group(f"edp.tp{c.tp}.stage{c.pp}.ep{c.replica % topology.ep}",
                               topology.expert_dp_ranks(c.tp, c.replica, c.pp))
    instance, position, expert_instance, size = None, None, None, 0
    if optimizer_instances is not None:
        size = topology.dp // optimizer_instances
        first = c.replica // size * size
        instance = make_group(f"distopt.tp{c.tp}.stage{c.pp}.replicas{first}",
                              topology.dp_cp_ranks(c.tp, c.pp, range(first, first + size)))
        place = c.replica % size
        position = make_group(f"distopt.tp{c.tp}.stage{c.pp}.place{place}{at}",
                              topology.dp_ranks(c.tp, c.pp, range(place, topology.dp, size), c.cp))
        if expert_dp is not None:  # MoE: units lie within instances (EP divides DP / K)
            expert_instance = make_group(
                f"distopt.tp{c.tp}.stage{c.pp}.replicas{first}.ep{c.replica % topology.ep}",
                topology.expert_dp_ranks(c.tp, c.replica, c.pp, range(first, first + size)))
    return ParallelGroups(topology, rank, c, tp, pp, replica, embedding, dp, self_group, instance,
                          size, position, p2p_channels(topology, c, make_group,
                                                       pp if channels == "shared" else None)
                          if channels and topology.pp > 1 else {}, resilient, context,
                          model_parallel, expert, tp_expert, expert_dp, alone, expert_instance)
