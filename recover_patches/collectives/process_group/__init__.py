"""ResilientProcessGroup: a torch ProcessGroup whose every operation completes or raises
PeerFailure within its bound, and whose inner backend can be replaced in place. Rules:
  * A newer epoch that declares a *member* dead (with `fate`, where the backend does not tell
    members that one left (NCCL): any rank of a member's replica, whose survivors leave as
    spares) discards the inner backend at once on every member; every
    later operation raises PeerFailure until a rebuild. A group whose fate is untouched adopts
    the epoch: a healthy replica never sees another's failure.
  * `rebuild`/`regroup(e, members, key)` raise PeerFailure if an epoch after e declares one of
    `members` dead (all survivors then retry with it); any other epoch (a replica growing back)
    leaves them to finish, each member alike, and is met at the iteration boundary. The
    rendezvous lives under (epoch, key), so processes with different histories meet in the same
    place; there the members decide together whether the backend is kept, shrunk or re-created.
  * A failed or timed-out operation is reported to the coordinator; its verdict (an epoch naming
    the dead, awaited up to `verdict_timeout`) names the right rank in the PeerFailure.
  * No thread and no callback per operation: the caller's wait() is the backend's. gloo blocks
    inside the backend, bounded by its timeouts, and fails within milliseconds when a peer's
    process dies or drops the group. NCCL only makes the stream wait: the process's watchdog
    (`watchdog.py`) bounds the work, aborts the communicator and latches a PeerFailure.
  * After a PeerFailure, do not reuse its buffers: the old backend may still write them. Works
    returned for async ops only implement wait() (is_completed() stays False).
It registers in torch.distributed's group tables: `dist.get_rank(group)`, `broadcast(src=...)` work.

The package: `resilient.py` the class; `departures.py` how members that gave up on a backend
tell the others where the backend does not (NCCL); `registry.py` its entries in torch's tables.
"""
from recover_patches.collectives.process_group.resilient import ResilientProcessGroup

__all__ = ["ResilientProcessGroup"]
