"""The membership coordinator: a small process outside the training ranks (design.md §6).

It owns the TCPStore server and decides membership epochs. A rank is declared dead on evidence
only: its launcher saw it exit (reported within milliseconds), its heartbeat went silent, or it
made no progress while the others reported waiting for it (`liveness.py`: stopped processes,
lost nodes, live hangs). Each batch of new deaths starts a new epoch; ranks watch the epoch key
and abort every pending operation of the old epoch. The waits follow the ranks'
`--recover-timeout` (`timeouts.py`), which the first rank to register brings; a rank with another
value is refused.

What does NOT start an epoch, and why:
  * a rank's own failure report (`suspect`): a timeout or a closed socket does not say who is at
    fault; it marks the rank as waiting, and the verdict is left to exits, heartbeats and
    progress;
  * a clean `leave` (surviving ranks of a broken replica) and any exit after the job declared
    completion: those ranks are recorded as gone without aborting everyone's work.

A restarted coordinator (`restarted=True`: the node-0 launcher starts a new one on the same port
when the first dies) begins with an empty store and rebuilds the membership from the ranks that
register again: each brings its latest epoch record, the newest is published as the current
epoch, spares report again; a rank that has not come back `stall` seconds after the first one
did is declared dead, as a silent rank would be. The launcher's store (the one the coordinator
process serves) is the remaining single point: see docs/failures.md, "The coordinator".

It also brings slots back (design.md §11, rules in `membership_state.py`): a grow epoch once a broken
replica's slots all have waiting processes, and dead slots no local replacement is coming for
handed to standby processes (`launch --standby`).

Run by hand (e.g. SLURM, on the first node):
    RECOVER_JOB_TOKEN=... python -m recover_patches.collectives.coordinator --port 29400 --world-size N
"""
from recover_patches.collectives.coordinator.core import (TICK, Coordinator, CoordinatorConfig,
                                                          MembershipState)
from recover_patches.collectives.coordinator.process import OWNER_STOP, main, run, start_server

__all__ = ["OWNER_STOP", "TICK", "Coordinator", "CoordinatorConfig", "MembershipState", "main",
           "run", "start_server"]
