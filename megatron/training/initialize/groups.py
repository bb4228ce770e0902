"""One rank's process groups, one object per role, and what the running job does with them:
regroup after a failure, rebuild on a join, abandon, and hand megatron-core its collection."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, cast

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.training.optimizer.shards import ShardDomain, Sharding
from recover_patches.collectives import Probe, Regrouped, ResilientGroup
from recover_patches.collectives.rendezvous import apply_all
from recover_patches.pipeline.interleaved import Kind
from recover_patches.pipeline.p2p import Channel
from recover_patches.topology import Coord, Topology


@dataclass
class ParallelGroups:
    topology: Topology
    rank: int
    coord: Coord
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    replica: dist.ProcessGroup  # all TP x PP ranks of this replica: grad norm
    embedding: dist.ProcessGroup | None  # first + last stage (tied embeddings), None if PP == 1
    dp: dist.ProcessGroup  # one rank per replica with this (tp, pp): gradient reduction
    self_group: dist.ProcessGroup  # size 1: megatron-core's context-parallel group
    # --use-distributed-optimizer: the DP x CP ranks of this rank's instance (the optimizer's
    # shards: a replica's CP ranks hold different ones, as in Megatron)
    instance: dist.ProcessGroup | None = None
    per_instance: int = 0  # replicas per instance (instance of replica r: r // per_instance)
    # the DP ranks at this rank's place (replica in its instance, CP index) in every instance:
    # its gradient range summed across them
    position: dist.ProcessGroup | None = None
    # model chunks (the interleaved schedule): a communicator per p2p channel, see p2p.ChunkP2P;
    # (kind, this rank sends) -> its channel, in creation order
    channels: dict[tuple[Kind, bool], Channel] = field(default_factory=dict)
    resilient: bool = False  # every group is a ResilientGroup (recovery on)
    # --context-parallel-size > 1: the ranks splitting this replica's sequences at this
    # (tp, pp), and the TP x PP ranks at this CP index (a gradient norm counts each weight once)
    context: dist.ProcessGroup | None = None
    model_parallel: dist.ProcessGroup | None = None
    # --expert-model-parallel-size > 1: the unit's ranks at this (tp, pp) (megatron-core's
    # expert-parallel group), at this stage (the dispatcher's TP x EP group), and the live
    # replicas' ranks holding this rank's experts (their gradients' reduction). `replica` then
    # spans the unit: it fails, votes and sums its norms as one
    expert: dist.ProcessGroup | None = None
    tp_expert: dist.ProcessGroup | None = None
    expert_dp: dist.ProcessGroup | None = None
    replica_alone: dist.ProcessGroup | None = None  # EP > 1: this replica's own TP x PP ranks
    # --use-distributed-optimizer with EP > 1: the replicas of this rank's instance holding its
    # experts (the experts' shards; their sum across instances is over `position`, whose members
    # hold the same experts since units lie within instances)
    expert_instance: dist.ProcessGroup | None = None

    @property
    def cp(self) -> dist.ProcessGroup:
        """megatron-core's context-parallel group (size 1 without CP)."""
        return self.context if self.context is not None else self.self_group

    @property
    def replica_positions(self) -> dist.ProcessGroup:
        """The replica's ranks less the copies CP holds of the same weights (TP x PP at this CP
        index): where a norm over its weights or gradients is summed, where a save's writers
        exchange their plans."""
        return self.model_parallel if self.model_parallel is not None else self.replica

    @property
    def save_positions(self) -> dist.ProcessGroup:
        """Where a save's writers exchange their plans: the positions of this replica alone (with
        expert parallelism `replica_positions` spans the unit, whose positions' plans the DP
        group's exchange already holds)."""
        return self.replica_alone if self.replica_alone is not None else self.replica_positions

    @property
    def optimizer_shards(self) -> int:
        """The distributed optimizer's shards per instance while every replica is live."""
        return self.per_instance * self.topology.cp

    @property
    def optimizer_shard(self) -> int:
        """This rank's shard: its holder index (`optimizer_holders`) within its instance."""
        return self.coord.replica % self.per_instance * self.topology.cp + self.coord.cp

    def optimizer_sharding(self) -> tuple[Sharding, Sharding | None]:
        """The distributed optimizer's dense and (EP > 1) expert shards while every replica is
        live: the experts' are the instance's units."""
        dense = Sharding(self.optimizer_shard, self.optimizer_shards, self.instance)
        if self.expert_instance is None:
            return dense, None
        ep = self.topology.ep
        return dense, Sharding(self.coord.replica % self.per_instance // ep,
                               self.per_instance // ep, self.expert_instance)

    def optimizer_domains(self, live_replicas: Sequence[int]
                          ) -> tuple[ShardDomain, ShardDomain | None]:
        """Who holds the dense and (EP > 1) the expert shards among the live replicas: the
        experts' holders are the live units (one replica each, holding this rank's experts),
        moving pieces over the expert-data-parallel group."""
        dense = ShardDomain(tuple(self.optimizer_holders(live_replicas)), self.optimizer_shards,
                            self.dp)
        if self.expert_instance is None:
            return dense, None
        ep = self.topology.ep
        units = tuple(r // ep for r in sorted(live_replicas) if r % ep == self.coord.replica % ep)
        return dense, ShardDomain(units, self.per_instance // ep, self.expert_dp)

    def optimizer_holders(self, live_replicas: Sequence[int]) -> list[int]:
        """Who holds the distributed optimizer's shards: holder r x CP + c is replica r's CP
        rank c, so instances are `optimizer_shards` consecutive holders and the DP group's ranks
        come in holder order (the rank order is (replica, cp) lexicographic in both of
        Megatron's orders)."""
        cp = self.topology.cp
        return [r * cp + c for r in sorted(live_replicas) for c in range(cp)]

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.topology.pp - 1

    def all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's groups in creation order (the order every member rebuilds them in)."""
        groups = [self.tp, self.pp, self.replica, self.embedding, self.dp, self.self_group,
                  self.context, self.model_parallel, self.expert, self.tp_expert, self.expert_dp,
                  self.replica_alone, self.instance, self.position, self.expert_instance,
                  *(c.group for c in self.channels.values())]
        return list({id(g): g for g in groups if g is not None}.values())  # shared channels: once

    def resilient_groups(self) -> list[ResilientGroup]:
        """The groups, if they are ReCoVer's own (built by a resilient factory: recovery on).
        torch's plain groups (no coordinator) have nothing to abandon, regroup or latch."""
        return cast(list[ResilientGroup], self.all_groups()) if self.resilient else []

    def before_parallel_ops(self, probe: Probe) -> None:
        """Fault injection and progress marks before each operation of the model-parallel
        groups: phase `tp_allreduce` (tensor parallel), `cp_exchange` (context parallel: the
        attention's K/V exchange), `ep_alltoall` / `ep_dispatch` (expert parallel: the token
        dispatcher's exchange, and its other operations)."""
        resilient = {id(g): g for g in self.resilient_groups()}
        phases: list[tuple[dist.ProcessGroup | None, Callable[[str], str]]] = [
            (self.tp, lambda op: "tp_allreduce"), (self.context, lambda op: "cp_exchange"),
            (self.tp_expert, lambda op: "ep_alltoall" if op == "alltoall" else "ep_dispatch")]
        for group, phase_of in phases:
            if group is not None and id(group) in resilient:
                resilient[id(group)].set_before_op(_probing(probe, phase_of))

    def raise_latched(self) -> None:
        """Before the commit vote: a rank votes only for a reduction that really ended. On NCCL,
        wait() returned before the device finished: wait for the device (bounded: the watchdog
        aborts a stuck collective), then raise what the watchdog latched. Nothing on gloo."""
        groups = self.resilient_groups()
        finished = next((event for g in groups if (event := g.stream_event()) is not None), None)
        if finished is not None:
            # Not a stream synchronize: a failure the epoch or the watchdog latched is raised
            # as soon as it is known (a busy backend whose member died is aborted at once)
            while not finished():
                for g in groups:
                    g.raise_latched()
                time.sleep(0.0005)
        for g in groups:
            g.raise_latched()

    def settle(self) -> None:  # start-up is over (an iteration committed): bounds are T
        for g in self.resilient_groups():
            g.settle()

    def raise_latched_of(self, *groups) -> None:
        """After a host read of what `groups` reduced: the failure latched for any of them (the
        others' failures belong to operations this read did not depend on)."""
        for g in self.resilient_groups():
            if any(g is mine for mine in groups):
                g.raise_latched()

    def abandon(self, phase: str = "execute") -> None:
        """Recovery starts: stop using the backends peers may be blocked on, so they fail fast.
        A rank that left in a phase with TP and PP operations (refresh, execute, step) may have
        left its peers mid-sequence: all of them. One that left in the reduction, the commit or
        a recovery attempt had issued every TP and PP operation of its round: only the groups
        those phases use, so the others can be kept (`regroup`)."""
        narrow = phase in ("reduce", "commit", "recovery")
        reduction = (self.replica, self.embedding, self.dp, self.instance, self.position,
                     self.model_parallel, self.expert_dp, self.expert_instance)
        for g in self.resilient_groups():
            if narrow and not any(g is h for h in reduction):
                continue
            g.abandon(f"recovery started in {phase}")

    def regroup(self, live_replicas: Sequence[int], epoch: int, key: str = "") -> Regrouped:
        """Groups for the agreed epoch: the DP group keeps one rank per live replica, the
        distributed optimizer's instance its live replicas. A group whose members all agree
        its message sequence is intact, and whose membership did not change, keeps its backend;
        the others are rebuilt (DP groups shrunk where NCCL can), all members deciding alike.
        On NCCL the new communicators connect concurrently."""
        c, topo = self.coord, self.topology
        size = self.per_instance or 1
        force = os.environ.get("RECOVER_REGROUP") == "all"  # the rebuild-all baseline (bench)
        plans = []
        for g in self.resilient_groups():
            members: Sequence[int] = g.members
            if g is self.dp:
                members = topo.dp_cp_ranks(c.tp, c.pp, live_replicas)
            elif g is self.instance:
                members = topo.dp_cp_ranks(c.tp, c.pp, [r for r in live_replicas
                                                        if r // size == c.replica // size])
            elif g is self.expert_dp:
                members = topo.expert_dp_ranks(c.tp, c.replica, c.pp, live_replicas)
            elif g is self.expert_instance:
                members = topo.expert_dp_ranks(c.tp, c.replica, c.pp, [
                    r for r in live_replicas if r // size == c.replica // size])
            elif g is self.position:
                members = topo.dp_ranks(c.tp, c.pp, [r for r in live_replicas
                                                     if r % size == c.replica % size], c.cp)
            plans.append((g, g.meet(epoch, members, key, force=force)))
        return apply_all(plans)

    def mend(self, epoch: int, key: str) -> Regrouped:
        """Before a rank rolls forward: the groups inside its replica (or unit), the ones its
        step may use, made whole on all their members -- a failed ack or exchange aborted one
        on some member. Kept where every member vouches for it, else rebuilt; the replica's
        members meet alone, the other replicas take no part. An epoch that breaks the replica
        ends the meeting at once (its members leave: none would come)."""
        unit = self.topology.unit_ranks(self.coord.replica)
        return apply_all([(g, g.meet(epoch, g.members, key, fate=unit))
                          for g in self.resilient_groups() if set(g.members) <= set(unit)])

    def pg_collection(self) -> ProcessGroupCollection:
        pgs = ProcessGroupCollection()
        pgs.tp = self.tp
        pgs.pp = self.pp
        pgs.cp = self.cp
        pgs.tp_cp = self.tp  # (read by transformer-engine's layers only, not used with CP)
        pgs.embd = self.embedding
        pgs.pos_embd = None
        pgs.dp = self.dp
        # mixture of experts without expert parallelism: every replica holds every expert,
        # tensor-parallel like the dense layers (their gradients reduced over the DP group like
        # theirs). expt_dp is read only for the experts' checkpoint replica ids: 0, as for the
        # dense weights (`torch_dist.model_sharded`; `checkpointing.writers` picks who writes)
        pgs.ep, pgs.expt_tp, pgs.tp_ep = self.self_group, self.tp, self.tp
        if self.expert is not None:  # MoE: the unit splits the experts, TP x EP ranks apiece
            pgs.ep, pgs.tp_ep = self.expert, self.tp_expert
        pgs.expt_dp = self.self_group
        pgs.tp_dp_cp = None  # the router's, for global_aux_loss only (refused: it spans replicas)
        return pgs


def _probing(probe: Probe, phase_of: Callable[[str], str]) -> Callable[[str], None]:
    return lambda op: probe.at(phase_of(op))
