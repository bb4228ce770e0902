"""--replication's copies (Megatron-LM's local checkpoints, through NVIDIA Resiliency
Extension) on ReCoVer's layout: which ranks hold a rank's state, and whether they are the same
(tp, pp) position in other replicas -- the only copies ReCoVer keeps (`checkpoint_local`)."""
from __future__ import annotations

from recover_patches.topology import Topology


def replication_cliques(jump: int, factor: int, world_size: int) -> list[tuple[int, ...]]:
    """NVIDIA Resiliency Extension's replica groups: ranks of equal `rank % jump`, `factor`
    consecutive ones at a time (the facts of --replication-jump / --replication-factor)."""
    cliques = []
    for start in range(jump):
        line = list(range(start, world_size, jump))
        cliques += [tuple(line[i:i + factor]) for i in range(0, len(line), factor)]
    return sorted(cliques)


def foreign_copy(topology: Topology, jump: int, factor: int) -> tuple[int, int] | None:
    """A (rank, holder) pair that --replication would put at different (tp, pp) positions, or
    None when every copy is the same position in another replica."""
    position = [(c.tp, c.pp) for c in map(topology.coord, range(topology.world_size))]
    for clique in replication_cliques(jump, factor, topology.world_size):
        for rank in clique[1:]:
            if position[rank] != position[clique[0]]:
                return clique[0], rank
    return None
