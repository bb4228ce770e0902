"""What a rank tells the coordinator about the job, and asks it: a failure it saw, that it waits
as a spare or joined with the state, that it leaves, that the job completed; whether the job
completed or stopped. A part of `MembershipClient`, over its store."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.bounded_call import BoundedCaller
from recover_patches.collectives.counted_store import CountedStore


class JobReports:
    """Reports and questions about the job (`MembershipClient` holds what they use)."""
    rank: int
    incarnation: int
    store: CountedStore
    generation: int
    _epoch: int
    _bounded: BoundedCaller
    _spare_slots: list[int] | None
    wait_reconnected: Callable[[int], bool]  # (generation): the coordinator is back
    reconnect_after: Callable[[int, Exception], None]  # (generation, why): register again

    def report_failure(self, suspects: Iterable[int], where: str) -> None:
        """An operation timed out or broke: this rank waits for the coordinator's verdict on
        `suspects` (the peers it waited for; empty if it cannot tell). Given up after a few
        seconds (the coordinator is restarting, or cut off: its successor's window covers us)."""
        report, store = P.Report.make("suspect", rank=self.rank, epoch=self._epoch,
                                      suspects=sorted(set(suspects)), where=where), self.store
        with contextlib.suppress(RuntimeError):
            self._bounded(lambda: P.post_report(store, report))

    def wait_as_spare(self, replica_slots: Iterable[int]) -> None:
        """Tell the coordinator this rank waits to re-form the replica of `replica_slots` (its
        own slots included); a grow epoch follows once every slot has a waiting process."""
        self._spare_slots = sorted(replica_slots)
        P.post_report(self.store, P.Report.make("spare", rank=self.rank, incarnation=self.incarnation,
                                                slots=sorted(replica_slots)))

    def joined(self) -> None:
        """This rank, brought back by a grow, received the state: its unit holds the job again."""
        P.post_report(self.store, P.Report.make("joined", rank=self.rank,
                                                incarnation=self.incarnation))

    def job_complete(self) -> bool:
        """Whether the job declared completion (one store check: for waiting spares)."""
        try:
            return self.store.check([P.COMPLETE])
        except RuntimeError:  # the coordinator is restarting: ask again later
            return False

    def job_stopped(self) -> str | None:
        """Why the job stopped before completion (no member left), else None."""
        try:
            return self.store.get(P.STOPPED).decode() if self.store.check([P.STOPPED]) else None
        except RuntimeError:  # the coordinator is restarting: ask again later
            return None

    def leave(self) -> None:
        """This rank quits cleanly (e.g. a survivor of a broken replica): no new epoch for it."""
        P.post_report(self.store, P.Report.make("leave", rank=self.rank))

    def declare_complete(self, timeout: float = 30.0) -> tuple[int, frozenset[int]]:
        """The job finished its work (call after the final commit/save). Returns the epoch and dead
        set the coordinator stamped; failed ranks dead by then no longer fail the launch."""
        generation = self.generation
        try:
            P.post_report(self.store, P.Report.make("complete", rank=self.rank))
            self.store.wait([P.COMPLETE], timedelta(seconds=timeout))
            record = json.loads(self.store.get(P.COMPLETE))
        except dist.DistNetworkError as lost:
            self.reconnect_after(generation, lost)
            if not self.wait_reconnected(generation):
                raise
            return self.declare_complete(timeout)  # to the restarted coordinator
        return record["epoch"], frozenset(record["dead"])
