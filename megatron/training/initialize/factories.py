"""Where groups come from: the default group for bootstrap, torch's plain groups, and layer 1's
resilient groups (recovery on). A `GroupFactory` is called only on member ranks."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from recover_patches.collectives import ResilientGroup
from recover_patches.placement import switch_of
from recover_patches.topology import Topology

GroupFactory = Callable[[str, Sequence[int]], dist.ProcessGroup]


def init_default_group(backend: str, timeout_minutes: float, joining: bool = False) -> tuple[int, int]:
    """Bootstrap group from the launcher's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A
    replacement process (`joining`) cannot enter the job's bootstrap rendezvous, which ended long
    ago: it gets torch's communication-free "fake" group of the same rank and size, so that
    `dist.get_rank()` (read by megatron-core) is right; all its traffic uses layer-1 groups.
    Without any of the launcher's env (`python pretrain_gpt_recover.py ...`): one process, world
    size 1, over a process-local store."""
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:  # no launcher: one process
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        elif joining:
            rank, world = env_rank_world()
            dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def env_rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def torch_group_factory(name: str, ranks: Sequence[int]) -> dist.ProcessGroup:
    return dist.new_group(list(ranks), use_local_synchronization=True, group_desc=name)


def resilient_group_factory(membership, timeout: float, backend: str = "gloo",
                            connect: bool = True, topology: Topology | None = None,
                            startup: float = 0.0) -> GroupFactory:
    """Layer 1 groups over `backend` (nccl on a GPU, gloo on CPU): every operation completes or
    raises PeerFailure within `timeout`. connect=False (a replacement process): the groups get
    their backends only when the process joins (`ParallelGroups.rebuild`). With `topology`, a
    group's backend ends when a member's unit (its replica, or the replicas sharing its experts)
    breaks: that unit's survivors leave every group as spares, and on NCCL nobody else would
    learn of it until their operation with them timed out. `startup`: the bound of the first
    connects and the first iteration, where longer than `timeout` (`ParallelGroups.settle`)."""
    from recover_patches.collectives.process_group import ResilientProcessGroup
    fate = None if topology is None else unit_fate(topology)

    def make(name: str, ranks: Sequence[int]) -> dist.ProcessGroup:
        # A short verdict wait: recovery agrees on the membership epoch itself, so an operation
        # need not wait for the coordinator to name the dead rank (a group broken only because a
        # peer abandoned it never gets a verdict at all).
        group = ResilientProcessGroup(name, ranks, membership=membership, timeout=timeout,
                                      backend=backend, verdict_timeout=0.25, connect=connect,
                                      fate=fate, startup=startup)
        conforming: ResilientGroup = group  # the type checker holds the class to the Protocol
        del conforming
        return group
    return make


def unit_fate(topology: Topology) -> Callable[[Sequence[int]], frozenset[int]]:
    """The ranks whose death ends a group of `members`: every rank of their units."""
    def fate(members: Sequence[int]) -> frozenset[int]:
        units = {topology.replica_of(m) for m in members}
        return frozenset(r for u in units for r in topology.unit_ranks(u))
    return fate


def gather_switches(node_size: int, joining: bool) -> tuple[str, ...]:
    """Each node's switch (SLURM_TOPOLOGY_ADDR less its node), gathered on rank 0 over the
    bootstrap group at start-up, for the failure-domain line; () where none is known, on the
    other ranks, and for a replacement process (no bootstrap group to gather on)."""
    if joining or dist.get_world_size() == 1:
        return ()
    mine = switch_of(os.environ.get("SLURM_TOPOLOGY_ADDR"))
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None or any(switch is None for switch in gathered):
        return ()
    return tuple(str(switch) for switch in gathered[::node_size])
