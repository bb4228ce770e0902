"""Megatron's non-persistent local checkpoints (--non-persistent-ckpt-type local): fast saves to
each node's own disk every --non-persistent-save-interval iterations, restored at start-up (with
--load, when newer than the persistent checkpoint) even after a node was lost.

Where the copies come from. Megatron-LM (through NVIDIA Resiliency Extension) sends each rank's
file to --replication-factor ranks --replication-jump apart. In ReCoVer every DP replica holds the
same state, so the same (tp, pp) position in another replica writes, on its own node, a file that
restores this rank just as well: the copies exist without sending anything. `--replication` asks
for copies on the ranks J apart; ReCoVer accepts it where those ranks are the same position in
other replicas (checked at start-up, one line naming --replication-jump otherwise).

Layout: LOCAL_DIR/<layout>/rank_RRRRR/iter_NNNNNNN.pt, the torch format's payload of that rank
(model, optimizer, schedule, RNG, progress), written atomically; a rank keeps its last two (one
is complete on every live rank while the next is written). A rank lists only its own directory:
on a node-local disk that is what it can read, and on a shared one it does not count another
rank's files as its own.

Restoring: the ranks gather what each holds; the newest iteration that every position holds
somewhere wins; a rank without its own copy gets one from the lowest DP peer that has it (a
broadcast in the position's DP group, the group the trainer already has).
"""
from __future__ import annotations

import argparse
import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.training.checkpointing.files import write_atomically
from megatron.training.checkpointing.format import iter_dir_name
from megatron.training.checkpointing.resume import ResumePoint
from megatron.training.checkpointing.state import CheckpointHost, apply_rank_state, rank_state
from megatron.training.checkpointing.writers import gather_object
from megatron.training.config.io import CheckpointConfig
from recover_patches.collectives.errors import PeerFailure
from recover_patches.topology import Topology

logger = logging.getLogger(__name__)

KEEP = 2  # files per rank: the newest may be incomplete on some rank when a job dies


def due(interval: int | None, iteration: int) -> bool:
    """A non-persistent save (--non-persistent-save-interval) follows this iteration."""
    return interval is not None and iteration % interval == 0


def layout_name(topology: Topology) -> str:
    order = "_tp_pp_dp" if topology.dp_last else ""  # --use-tp-pp-dp-mapping numbers ranks so
    return f"tp{topology.tp}_pp{topology.pp}_dp{topology.dp}{order}"


@dataclass(frozen=True)
class Inventory:
    """Who holds which iterations (global rank -> iterations), and the one to restore."""
    held: dict[int, frozenset[int]]
    iteration: int | None

    def lacking(self) -> list[int]:
        """The ranks that restore from a peer's copy."""
        return sorted(r for r, iterations in self.held.items() if self.iteration not in iterations)


class LocalCheckpoints:
    """This rank's local checkpoints under `directory`, every `interval` iterations."""

    def __init__(self, directory: str, interval: int | None, config: CheckpointConfig,
                 topology: Topology, rank: int) -> None:
        self.config, self.interval, self.topology, self.rank = config, interval, topology, rank
        self.root = Path(directory) / layout_name(topology)
        self.mine = self.root / f"rank_{rank:05d}"

    def due(self, iteration: int) -> bool:
        return due(self.interval, iteration)

    # -- saving ---------------------------------------------------------------------------------
    def save(self, host: CheckpointHost) -> None:
        iteration = host.training_state.progress.iteration
        start = time.perf_counter()
        host.weights_ready()
        try:  # the distributed optimizer gathers its shards: a collective
            optimizer_state = host.training_state.optimizer.state_dict() if self.config.save_optim \
                else None
        except PeerFailure as err:
            logger.warning(f"local checkpoint of iteration {iteration} abandoned ({err})")
            return
        state = rank_state(host.training_state, self.config, optimizer_state)
        self.mine.mkdir(parents=True, exist_ok=True)
        write_atomically(self.mine / f"{iter_dir_name(iteration)}.pt",
                         lambda file: torch.save(state, file))
        for old in sorted(self._held(), reverse=True)[KEEP:]:
            (self.mine / f"{iter_dir_name(old)}.pt").unlink(missing_ok=True)
        if self.rank == 0:
            logger.info(f"local checkpoint stall: iteration {iteration}, "
                        f"{(time.perf_counter() - start) * 1e3:.1f} ms ({self.root})")

    def _held(self) -> list[int]:
        if not self.mine.is_dir():
            return []
        return [int(p.stem.removeprefix("iter_")) for p in self.mine.glob("iter_*.pt")
                if p.stem.removeprefix("iter_").isdigit()]

    # -- restoring (collective, at start-up) -----------------------------------------------------
    def inventory(self, host: CheckpointHost) -> Inventory:
        """What every rank holds, and the newest iteration each (tp, pp) position has somewhere."""
        groups = host.training_state.groups
        device = host.training_state.device
        by_position = gather_object(gather_object((self.rank, sorted(self._held())), groups.dp,
                                                  device), groups.replica, device)
        held = {rank: frozenset(iters) for position in by_position for rank, iters in position}
        topo = self.topology
        per_position: dict[tuple[int, int], set[int]] = {}
        for rank, iterations in held.items():
            c = topo.coord(rank)
            per_position.setdefault((c.tp, c.pp), set()).update(iterations)
        common = set.intersection(*per_position.values()) if per_position else set()
        return Inventory(held, max(common) if common else None)

    def restore(self, host: CheckpointHost, persistent: ResumePoint | None) -> bool:
        """Load the newest local checkpoint if it is at least as new as `persistent` (Megatron's
        rule); False: nothing loaded. Collective: the same answer on every rank."""
        inventory = self.inventory(host)
        if inventory.iteration is None or (persistent is not None
                                           and inventory.iteration < persistent.iteration):
            if self.rank == 0 and inventory.iteration is not None:
                logger.info("local checkpoints are older than the persistent checkpoint")
            return False
        apply_rank_state(host.training_state, self.read(host, inventory), self.config)
        if self.rank == 0:
            peers = inventory.lacking()
            logger.info(f"loaded local checkpoint of iteration {inventory.iteration} from "
                        f"{self.root}" + (f"; rank(s) {peers} had no copy of their own and "
                                          "took a DP peer's" if peers else ""))
        return True

    def read(self, host: CheckpointHost, inventory: Inventory) -> dict:
        """This rank's state at the inventory's iteration (collective over the DP group)."""
        iteration = inventory.iteration
        assert iteration is not None, "read() with nothing to restore"
        dp = host.training_state.groups.dp
        peers = dist.get_process_group_ranks(dp)
        holders = [r for r in peers if iteration in inventory.held[r]]
        lacking = [r for r in peers if r not in holders]
        mine = self.mine / f"{iter_dir_name(iteration)}.pt"
        data = mine.read_bytes() if self.rank in holders else None
        if lacking:  # the lowest holder sends its copy; the other holders keep their own
            sent = self._broadcast(data if self.rank == holders[0] else None, holders[0], dp,
                                   host.training_state.device)
            data = data if data is not None else sent
        assert data is not None
        with torch.serialization.safe_globals([argparse.Namespace]):  # Megatron's "args"
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    @staticmethod
    def _broadcast(data: bytes | None, source: int, group: dist.ProcessGroup,
                   device: torch.device) -> bytes:
        """`data` from global rank `source` (which passes it; the others pass None) to all."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                            device=device)
        dist.broadcast(size, src=source, group=group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if data is not None:
            payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(payload, src=source, group=group)
        return payload.cpu().numpy().tobytes()
