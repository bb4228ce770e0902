"""Growing back (design.md §11): spares and replacement processes re-form replicas at an iteration
boundary, and a live donor replica hands them its state.

Who waits: the surviving ranks of a broken replica (instead of leaving) and replacement processes
a launcher started for dead ranks. Each tells the coordinator it waits to re-form its replica;
once every rank of that replica has a waiting process, the coordinator publishes a *grow epoch*
in which those ranks count as members again.

When: the live ranks learn of the epoch through the commit vote (COMMIT_AND_SYNC: some member saw
a newer epoch) or, if the epoch was agreed during a recovery, from `LiveReplicas.joinable()`.
Both are the same on every live rank, so all of them call `at_boundary` after the same iteration.

How (one attempt per membership epoch, both sides):
    1. live ranks agree on the epoch, drop replicas it broke, announce {iteration, live, donor}
       under the epoch (the first announcement wins); spares wait for that announcement
    2. everyone in the new membership meets (store barrier), rebuilds every group
    3. each rank of the donor replica sends its slot's state to the same slot of each joining
       replica over the rebuilt data-parallel group
    4. a commit vote over all of them: the join took effect everywhere or nowhere
If the vote aborts (a joiner or the donor failed, or timed out), every live rank abandons the
join alike and rebuilds its groups among the live replicas; spares go back to waiting and report
again, and the coordinator's next grow epoch brings the next attempt -- or, if someone died, the
death epoch does (another donor, or without the broken joiners). Live ranks never change their
training state in a join, so an aborted one costs only time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from recover_patches.collectives import (NO_PROBE, MembershipTimeout, PeerFailure, Probe,
                                         Regrouped)
from recover_patches.recovery.agreement import Decision, StoreAgreement
from recover_patches.recovery.iteration import LiveReplicas


class JobComplete(Exception):
    """The job finished while this rank waited as a spare."""


class JobStopped(Exception):
    """The job stopped (no live replica left) while this rank waited as a spare."""


class Membership(Protocol):
    def epoch(self) -> int: ...

    def view(self) -> tuple[int, frozenset[int]]: ...

    def wait_for_epoch_after(self, epoch: int, timeout: float) -> int: ...

    def wait_as_spare(self, replica_slots: list[int]) -> None: ...

    def joined(self) -> None: ...

    def job_complete(self) -> bool: ...

    def job_stopped(self) -> str | None: ...


class ReplicaState(Protocol):
    """What a join needs of this rank: its groups and the state a donor sends."""

    def abandon(self, phase: str) -> None:
        """Drop the groups' backends (peers blocked on them fail fast)."""

    def rebuild(self, live_replicas: list[int], epoch: int, key: str) -> Regrouped:
        """Groups for `live_replicas` at `epoch`."""

    def send_state(self, replica: int) -> int:
        """A donor rank: its slot's state to the same slot of `replica`; the bytes sent."""

    def receive_state(self, replica: int) -> int:
        """A joining rank: its slot's state from donor `replica`; the bytes received."""


@dataclass
class JoinRecord:
    """One join, for logs and metrics (on every rank that took part)."""
    iteration: int  # the join happened after this iteration
    epoch: int
    live: list[int]  # live replicas afterwards
    joined: list[int]
    dropped: list[int]  # replicas the agreed epoch broke (their survivors become spares)
    donor: int
    attempts: int
    bytes_sent: int = 0  # this rank's share (donor ranks only)
    bytes_received: int = 0  # joining ranks only
    abandoned: list[int] = field(default_factory=list)  # replicas whose join aborted
    seconds: dict[str, float] = field(default_factory=dict)  # pause / transfer
    # the step after the iteration that made the join: "boundary" (before that iteration's save
    # and evaluation, which the joiners then make with the others) or "eval" (after them)
    after: str = "boundary"


@dataclass
class GrowBack:
    live: LiveReplicas
    agreement: StoreAgreement
    membership: Membership
    replica: ReplicaState
    probe: Probe = NO_PROBE  # progress marks and fault injection: phase "join"
    max_attempts: int = 64
    failed: set[int] = field(default_factory=set)  # epochs whose join aborted: one try each
    unit_size: int = 1  # a joiner's donor holds the same experts or shard (replica % unit_size)

    # --- live ranks ---------------------------------------------------------------------------
    def due(self, sync: bool) -> bool:
        """After a commit: a member saw a newer epoch, or the agreed one lets a replica re-form
        (and no join failed at it already). The same answer on every live rank."""
        return sync or (bool(self.live.joinable()) and self.live.epoch not in self.failed)

    def at_boundary(self, iteration: int, sync: bool, key: str = "boundary") -> JoinRecord:
        """Adopt the newer membership after `iteration`: drop broken replicas, bring in the
        re-formed ones. Raises ReplicaLost (this replica broke) or TooFewReplicas. `key` names
        the step after the iteration that calls it (the boundary itself, or an evaluation)."""
        m, start = self.live, time.perf_counter()
        agree = sync
        for attempt in range(self.max_attempts):
            try:
                if agree:
                    epoch, dead = self.agreement.agree_on_epoch(f"{key}/{iteration}/{attempt}",
                                                                m.epoch)
                else:  # the agreed epoch already lets a replica re-form
                    epoch, dead = m.epoch, m.dead
                dropped = m.adopt_epoch(epoch, dead)
                joining = [] if epoch in self.failed else m.joinable()
                plan = self.agreement.announce_join(epoch, {
                    "iteration": iteration, "after": key, "live": sorted(m.live_replicas + joining),
                    "donor": min(m.live_replicas),
                    "donors": [[r, self._donor(r)] for r in joining]})
                joined = [r for r in plan["live"] if r not in m.live_replicas]
                transfer, sent = self._meet(plan, epoch, joined)
                if sent is None:  # aborted on every member alike: go on without the joiners
                    self.failed.add(epoch)
                    self.replica.abandon("join")
                    self.agreement.abandon_join(epoch)
                    self.agreement.barrier(f"join/{epoch}/fallback", m.members(), epoch)
                    self.replica.rebuild(m.live_replicas, epoch, f"join/{epoch}/fallback")
                    joined, abandoned = [], joined
                else:
                    abandoned = []
                    m.adopt_join(plan["live"])
            except PeerFailure:  # a newer epoch (or a hung peer: the agreement says which)
                self.replica.abandon("join")
                agree = True
                continue
            return JoinRecord(iteration, epoch, list(m.live_replicas), joined, dropped,
                              plan["donor"], attempt + 1, bytes_sent=sent or 0,
                              seconds={"pause": time.perf_counter() - start, "transfer": transfer},
                              abandoned=abandoned, after=key)
        raise RuntimeError(f"after iteration {iteration}: the membership change did not converge")

    def _meet(self, plan: dict, epoch: int, joined: list[int]) -> tuple[float, int | None]:
        """Steps 2-4 on a live rank: (transfer seconds, bytes sent, or None if the vote aborted;
        a failure here is voted as an abort, so every member ends the attempt alike)."""
        members = self.live.members(plan["live"])
        clock, sent = time.perf_counter(), 0
        try:
            self.agreement.barrier(f"join/{epoch}", members, epoch)
            self.replica.rebuild(plan["live"], epoch, f"join/{epoch}")
            clock = time.perf_counter()
            for replica, donor in plan["donors"]:
                if self.live.replica == donor:
                    self.probe.at("join")
                    sent += self.replica.send_state(replica)
            ok = True
        except PeerFailure:
            ok = False
        transfer = time.perf_counter() - clock
        decision = self.agreement.commit_vote(f"join/{epoch}", members, reduced_ok=ok,
                                              per_rank=True)
        return transfer, (sent if decision.committed else None)

    def _donor(self, joiner: int) -> int:
        """The lowest live replica holding what `joiner` holds: any one, or with expert
        parallelism one with its experts (a unit is live whole, so one is)."""
        return min(r for r in self.live.live_replicas if r % self.unit_size == joiner % self.unit_size)

    # --- spares -------------------------------------------------------------------------------
    def wait_as_spare(self) -> JoinRecord:
        """Wait (no collectives; store checks backing off to 50 ms) until this rank's replica is
        re-formed and joined; return the join. Raises JobComplete / JobStopped if the job ends
        first."""
        m, slots = self.live, self.live.replica_ranks(self.live.replica)
        self.membership.wait_as_spare(slots)
        seen = -1
        while True:
            self._check_job()
            epoch, dead = self.membership.view()
            if epoch == seen:
                try:
                    self.membership.wait_for_epoch_after(seen, 0.5)
                except MembershipTimeout:
                    pass
                continue
            seen = epoch
            if dead & set(slots):  # not re-formed (again, after a failed join): keep waiting
                self.membership.wait_as_spare(slots)
                continue
            plan = self.agreement.wait_for_join(
                epoch, give_up=lambda: self.membership.epoch() > epoch or self._job_over())
            if plan is None:
                continue
            if m.replica not in plan["live"]:  # the live ranks gave up on this epoch's join
                self.membership.wait_as_spare(slots)
                continue
            start = time.perf_counter()
            members, donor = m.members(plan["live"]), dict(plan["donors"])[m.replica]
            received, ok = 0, True
            try:
                self.agreement.barrier(f"join/{epoch}", members, epoch)
                self.replica.rebuild(plan["live"], epoch, f"join/{epoch}")
                self.probe.at("join")  # (the joining side: about to receive the state)
                received = self.replica.receive_state(donor)
            except PeerFailure:
                ok = False
            decision = self.agreement.commit_vote(f"join/{epoch}", members, reduced_ok=ok,
                                              per_rank=True)
            if decision is Decision.ABORT:
                self.replica.abandon("join")
                self._after_abort(epoch, slots)
                continue
            m.adopt_join(plan["live"], epoch, dead)
            self.membership.joined()  # without it, the coordinator counts no holder in this unit
            return JoinRecord(plan["iteration"], epoch, list(plan["live"]), [m.replica], [],
                              donor, 1, bytes_received=received,
                              seconds={"pause": time.perf_counter() - start},
                              after=plan.get("after", "boundary"))

    def _after_abort(self, epoch: int, slots: list[int]) -> None:
        """A death explains most aborted joins: its epoch follows, and the live ranks retry with
        it. Only if they give up on this epoch's join do the spares report again (reporting
        at once would start a grow epoch that interrupts the live ranks' retry, forever)."""
        while self.membership.epoch() == epoch and not self._job_over():
            if self.agreement.join_abandoned(epoch):
                self.membership.wait_as_spare(slots)
                return
            time.sleep(0.05)

    def _job_over(self) -> bool:
        return self.membership.job_complete() or self.membership.job_stopped() is not None

    def _check_job(self) -> None:
        if self.membership.job_complete():
            raise JobComplete("the job completed while this rank waited as a spare")
        stopped = self.membership.job_stopped()
        if stopped is not None:
            raise JobStopped(stopped)
