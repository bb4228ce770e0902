"""Nodes as failure domains (design.md §3): which ranks share a node (and, under SLURM, a switch),
what losing one costs a layout, and the rank order that puts replicas on disjoint nodes.

A GPU, host or NIC fault takes a node's ranks at once. Megatron's default order
(`tp-cp-ep-dp-pp`) lays the replicas' stages side by side, so one node can hold stage 0 of every
replica: at TP 2 x PP 2 x DP 2 on two nodes of 4, losing either node breaks both replicas. The
trajectory does not depend on which rank sits where (a microbatch's randomness and place in the
reduction follow its id and its (tp, pp) position, design.md §8), so ReCoVer's placement
(`--recover-placement recover`, the default) orders ranks `tp-cp-ep-pp-dp` -- each replica, and
each unit, contiguous -- whenever that makes the worst single node loss take fewer units than
Megatron's order; otherwise Megatron's order stays, since it keeps the DP reduction inside a
node where it can. TP and CP stay inside a node in both orders (they vary fastest).

Pure arithmetic, no torch: every rank computes the same answers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from recover_patches.topology import Topology

PLACEMENTS = ("recover", "megatron")  # --recover-placement
ORDERS = {False: "tp-cp-ep-dp-pp", True: "tp-cp-ep-pp-dp"}  # Megatron's names, by `dp_last`


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: `size` ranks each (the launchers' --nproc-per-node, LOCAL_WORLD_SIZE),
    node n holding ranks n*size ... (n+1)*size - 1 as every launcher numbers them; `switches`
    names each node's switch where known (SLURM_TOPOLOGY_ADDR less its last part)."""
    size: int
    world_size: int
    switches: tuple[str, ...] = ()

    def __post_init__(self):
        if not 1 <= self.size or self.world_size < 1:
            raise ValueError(f"{self.size} ranks per node, world of {self.world_size}")
        if self.switches and len(self.switches) != self.count:
            raise ValueError(f"{len(self.switches)} switch names for {self.count} nodes")

    @property
    def count(self) -> int:
        return -(-self.world_size // self.size)

    def node_of(self, rank: int) -> int:
        return rank // self.size

    def node_ranks(self) -> list[list[int]]:
        return [list(range(n * self.size, min((n + 1) * self.size, self.world_size)))
                for n in range(self.count)]

    def switch_ranks(self) -> list[list[int]]:
        """The ranks under each switch (none known: no list)."""
        under: dict[str, list[int]] = {}
        for node, ranks in zip(self.switches, self.node_ranks()):
            under.setdefault(node, []).extend(ranks)
        return list(under.values())


def switch_of(address: str | None) -> str | None:
    """A node's switch from its SLURM_TOPOLOGY_ADDR (`switch0.switch3.node7`): all but the last
    part; None where SLURM set none, or the node hangs off no switch."""
    if not address or "." not in address:
        return None
    return address.rsplit(".", 1)[0]


@dataclass(frozen=True)
class DomainLoss:
    """What losing the worst one of `count` failure domains (nodes, or switches) costs."""
    kind: str  # "node" or "switch"
    count: int
    units: int  # units (replicas, or EP / FSDP groups) in the job
    worst_units: int  # units the worst single loss breaks
    unit_size: int  # replicas per unit

    def survived(self, min_replicas: int = 1) -> bool:
        """Whether the job goes on after any one such loss: a complete unit, and at least
        --recover-min-replicas replicas, are left."""
        left = self.units - self.worst_units
        return left >= 1 and left * self.unit_size >= min_replicas

    def taken(self) -> str:
        """`1 of 2 replicas`, or with units wider than a replica `1 of 2 units (2 of 4
        replicas)`."""
        if self.unit_size == 1:
            return f"{self.worst_units} of {self.units} replicas"
        return (f"{self.worst_units} of {self.units} units ({self.worst_units * self.unit_size} "
                f"of {self.units * self.unit_size} replicas)")


def domain_loss(topology: Topology, domains: Sequence[Sequence[int]], kind: str) -> DomainLoss:
    """The units each domain's loss breaks (any of a unit's ranks breaks it), at worst."""
    worst = max((len({topology.replica_of(r) // topology.unit_size for r in ranks})
                 for ranks in domains), default=0)
    return DomainLoss(kind, len(domains), topology.dp // topology.unit_size, worst,
                      topology.unit_size)


def placed(topology: Topology, nodes: Nodes, placement: str) -> Topology:
    """The topology with the rank order `placement` picks (`--use-tp-pp-dp-mapping` already
    gives the contiguous order and is kept, as `megatron` keeps the default one)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} not in {PLACEMENTS}")
    if placement == "megatron" or topology.dp_last:
        return topology
    contiguous = replace(topology, dp_last=True)
    nodes_of = nodes.node_ranks()
    if domain_loss(contiguous, nodes_of, "node").worst_units < \
            domain_loss(topology, nodes_of, "node").worst_units:
        return contiguous
    return topology


def startup_line(asked: Topology, nodes: Nodes, placement: str, min_replicas: int = 1,
                 one_optimizer_copy: bool = False) -> str:
    """The one start-up line on the layout's failure domains and the placement chosen; `asked`
    is the order the flags name (Megatron's, or --use-tp-pp-dp-mapping's)."""
    topology = placed(asked, nodes, placement)
    node = domain_loss(topology, nodes.node_ranks(), "node")
    parts = [f"failure domains: {_domains(node, nodes.size)}, "
             f"{_verdict(node, min_replicas, one_optimizer_copy)}"]
    if nodes.switches:
        switch = domain_loss(topology, nodes.switch_ranks(), "switch")
        parts.append(f"{_domains(switch)}, {_verdict(switch, min_replicas, one_optimizer_copy)}")
    parts.append(_placement_note(asked, topology, nodes, placement))
    return "; ".join(parts)


def _domains(loss: DomainLoss, size: int | None = None) -> str:
    each = f" of {size} ranks" if size is not None else ""
    return f"{loss.count} {loss.kind}{_plural(loss)}{each}"


def _verdict(loss: DomainLoss, min_replicas: int, one_optimizer_copy: bool) -> str:
    lost = f"losing one takes at worst {loss.taken()}"
    if one_optimizer_copy:
        return f"{lost}: any replica loss ends the job (one copy of the optimizer state)"
    if loss.survived(min_replicas):
        return f"{lost}: the job survives any one {loss.kind} loss"
    return f"{lost}: one {loss.kind} loss ends the job (restart from a checkpoint)"


def _placement_note(asked: Topology, topology: Topology, nodes: Nodes, placement: str) -> str:
    order = ORDERS[topology.dp_last]
    if placement == "megatron":
        return f"placement: Megatron's order {order} (--recover-placement megatron)"
    if topology != asked:
        megatron = domain_loss(asked, nodes.node_ranks(), "node")
        return (f"placement: replicas on disjoint nodes, rank order {order} (Megatron's "
                f"{ORDERS[False]} would lose {megatron.taken()} with one node): the rank-to-node "
                "mapping changes, the math does not; --recover-placement megatron keeps "
                "Megatron's order")
    return f"placement: rank order {order}"


def _plural(loss: DomainLoss) -> str:
    return "" if loss.count == 1 else "es" if loss.kind == "switch" else "s"
