"""Where an elected coordinator keeps its decisions durable: the membership epoch it is about
to publish, the slots it gives to standby processes and the job's completion, written to etcd
*before* any rank or standby is told, each write fenced by the leader key's revision
(`Election.write`). So a coordinator whose node lost the lease cannot
decide anything more, even before its launcher notices and stops it: its next write is refused
and it exits (`Fenced`). A successor starts from the last epoch the journal holds; the ranks'
rejoin records can only repeat it (nothing reached a rank without passing the journal first).
It also keeps the standbys' grants, so it never gives a slot twice: joins need no record of their
own, a joining process registers again and is admitted by a journaled epoch.

Without `--rdzv-backend etcd` a coordinator has no journal: node 0's store is the record, as
before."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the coordinator imports this module: no etcd client unless elected
    from recover_patches.collectives.election import Election, Leadership

EPOCH, COMPLETE, STANDBYS = "epoch", "complete", "standbys"  # the journal's records


class Journal(Protocol):
    def record(self, name: str, record: dict) -> bool: ...  # False: fenced (not the leader)

    def read(self, name: str) -> dict | None: ...


class Fenced(RuntimeError):
    """Another node's coordinator leads now: this one must not publish what it decided."""


class ElectionJournal:
    """A Journal in etcd under the job's prefix, written only while `leadership` holds."""

    def __init__(self, election: Election, leadership: Leadership):
        self.election, self.leadership = election, leadership

    def record(self, name: str, record: dict) -> bool:
        return self.election.write(self.leadership, name, record)

    def read(self, name: str) -> dict | None:
        return self.election.read(name)


def write_or_fence(journal: Journal | None, name: str, record: dict) -> None:
    """Journal `record` (nothing without a journal), or raise Fenced."""
    if journal is None:
        return
    try:
        written = journal.record(name, record)
    except RuntimeError as unreachable:  # etcd's majority out of reach: this side may be the
        raise Fenced(f"{name} not published: etcd unreachable ({str(unreachable)[:80]})") \
            from None  # minority of a partition, so nothing it decides may count
    if not written:
        raise Fenced(f"{name} {record.get('epoch', '')} not published: this node no longer holds "
                     "the job's lease (another node's coordinator leads)")
