"""One training iteration as a transaction, and its recovery loop (design.md §4):

    1. plan     layer 3 maps the M global microbatch ids to the live replicas
    2. execute  this replica runs its pipeline schedule over its quota; grads accumulate locally
                (first `refresh`: a replica whose weights are incomplete -- the distributed
                optimizer's all-gather failed after the last commit -- computes nothing and
                recovers; a replica whose round 0 stopped short on any rank, e.g. waiting for
                an overlapped all-gather mid-forward, or computed on weights an aborted
                all-gather left half-written, computes its quota again from zero, with its
                share of the lost ids)
    3. reduce   out-of-place DP reduction of grads + microbatch count, tokens, id checksums, loss;
                tied-embedding and sequence-parallel sync; then the results are validated
                (--rerun-mode: a non-finite loss is re-run on another replica, and a replica
                whose result did not repeat is fenced)
    4. commit   an ack over the DP group, an exchange over the replica: the round committed
                without a store operation (`settle.py` says why that is safe); exactly the
                planned ids were reduced, else stop loudly (a bug, not a failure)
    5. step     divide by the global token count, clip, optimizer, LR schedule

A PeerFailure in 2-4 is settled first (`settle.py`, through the store): if the round committed
elsewhere -- this rank's ack or exchange failed after the others' completed -- this rank holds its
full sum and steps with it ("rolls forward"). Otherwise every survivor enters recovery: agree on
the new membership epoch, drop the broken replicas (with expert parallelism, whole units), rebuild
the DP groups among the survivors, re-plan *only the ids the broken replicas owned*, compute them
on top of the gradients already accumulated, and reduce again.
Nothing is rolled back, no survivor recomputes its own microbatches, and a failure during recovery
simply starts the next round. What a replica does in each phase is one object, a `ReplicaStep`
(`parts.py`; its implementation: `megatron/training/step/replica.py`), so this file shows the
whole order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Sequence

from recover_patches.collectives import NO_PROBE, PeerFailure, Probe, Regrouped
from recover_patches.recovery.decision import Decision
from recover_patches.recovery.grad_buffer import ReducedGradients
from recover_patches.recovery.parts import Agreement, ReplicaStep
from recover_patches.recovery.reduce import Totals, check_commit
from recover_patches.recovery.settle import NOTHING, SUM


class ReplicaLost(Exception):
    """This rank's replica lost a member: the rank has nothing left to contribute and leaves."""


class TooFewReplicas(Exception):
    """Fewer complete replicas remain than required: the job stops (checkpoint-restart)."""


class StepInterrupted(RuntimeError):
    """A rank of a live replica failed inside its step (after the commit): a step never runs
    twice, so it leaves as a dead rank would (a lost member: ReplicaLost is raised first)."""


@dataclass
class LiveReplicas:
    """What the transaction knows of the job: who is live, as last agreed by all survivors."""
    replica: int  # this rank's replica
    live_replicas: list[int]
    epoch: int  # the last agreed membership epoch
    replica_ranks: Callable[[int], list[int]]
    min_replicas: int = 1
    replicas: int = 0  # all replicas of the layout (DP): the ones not live may grow back
    dead: frozenset[int] = frozenset()  # the agreed epoch's dead ranks
    unit_ranks: Callable[[int], list[int]] | None = None  # whose death breaks r: its unit

    @classmethod
    def solo(cls) -> LiveReplicas:
        """One replica of one rank: a one-process run."""
        return cls(replica=0, live_replicas=[0], epoch=0, replica_ranks=lambda r: [r], replicas=1)

    def members(self, replicas: list[int] | None = None) -> list[int]:
        chosen = self.live_replicas if replicas is None else replicas
        return [rank for r in chosen for rank in self.replica_ranks(r)]

    def broken(self, dead: frozenset[int]) -> set[int]:
        return {r for r in self.live_replicas if dead & set(self._needs(r))}

    def _needs(self, replica: int) -> list[int]:  # the ranks without which it cannot compute
        return (self.unit_ranks or self.replica_ranks)(replica)

    def adopt_epoch(self, epoch: int, dead: frozenset[int]) -> list[int]:
        """Take an agreed epoch: drop the live replicas it broke and return them. Raises
        TooFewReplicas or ReplicaLost (this rank's replica broke), alike on every survivor."""
        lost = sorted(self.broken(dead))
        self.live_replicas = [r for r in self.live_replicas if r not in lost]
        self.epoch, self.dead = epoch, dead
        required = max(1, self.min_replicas)
        if len(self.live_replicas) < required:
            raise TooFewReplicas(f"{len(self.live_replicas)} complete replica(s) left, "
                                 f"{required} required")
        if self.replica in lost:
            mine = sorted(dead & set(self._needs(self.replica)))
            raise ReplicaLost(f"replica {self.replica} lost rank(s) {mine}")
        return lost

    def adopt_join(self, live: Sequence[int], epoch: int | None = None,
                   dead: frozenset[int] | None = None) -> None:
        """Take a join that committed: `live` replicas from now on (a spare also takes the
        join's epoch and its dead ranks)."""
        self.live_replicas = list(live)
        if epoch is not None:
            self.epoch = epoch
        if dead is not None:
            self.dead = dead

    def joinable(self) -> list[int]:
        """Replicas not live whose every rank the agreed epoch counts as a member again."""
        return [r for r in range(self.replicas) if r not in self.live_replicas
                and not self.dead & set(self._needs(r))]


@dataclass
class RecoveryRecord:
    """One recovery, for logs and metrics."""
    round: int  # agreement attempts made so far in the iteration
    failure: str  # the PeerFailure (group.op, suspects) that started it
    phase: str  # where this rank saw it: refresh / execute / reduce / commit / step
    epoch: int
    dead: list[int]
    lost_replicas: list[int]
    lost_ids: list[int]
    replanned: dict[int, list[int]]
    seconds: dict[str, float] = field(default_factory=dict)  # detection / rebuild / recompute
    redo: bool = False  # this replica's round 0 stopped short: it computes its quota again
    groups_rebuilt: list[str] = field(default_factory=list)  # this rank's, by name
    groups_kept: list[str] = field(default_factory=list)  # backend intact on every member
    groups_shrunk: list[str] = field(default_factory=list)  # NCCL: shrunk, not re-created
    connect_seconds: float = 0.0  # of `rebuild`: creating or shrinking backends
    rolled_forward: bool = False  # the round committed elsewhere: this rank stepped with its sum


@dataclass
class _Progress:
    """One iteration's ids and what the transaction learned of them so far."""
    iteration: int
    ids: list[int]
    owner: dict[int, int]  # round-0 owner of every id, never changed
    replanned: dict[int, list[int]] = field(default_factory=dict)  # this recovery round's plan
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("execute", "reduce", "commit"), 0.0))
    recoveries: list[RecoveryRecord] = field(default_factory=list)


@dataclass
class IterationOutcome:
    iteration: int
    ids: list[int]  # the ids committed
    assignment: dict[int, list[int]]  # final owner of every id, by replica
    totals: Totals
    step: dict  # what the step reports: loss, grad_norm, lr, ...
    seconds: dict[str, float] = field(default_factory=dict)  # execute / reduce / step
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    sync: bool = False  # a member saw a newer membership epoch: meet at the boundary


@dataclass
class IterationTransaction:
    live: LiveReplicas
    replica: ReplicaStep
    agreement: Agreement | None = None  # None: no recovery -- a PeerFailure propagates
    drop_lost: bool = False  # the replica-dropping baseline: skip lost ids instead of recomputing
    on_failure: Callable[[PeerFailure, str], None] | None = None  # per-rank report, at once
    probe: Probe = NO_PROBE  # progress marks and fault injection: phase "recovery"
    max_attempts: int = 64
    # Agreement attempts made in the current iteration. Ranks can fail at different steps of a
    # recovery, but every attempt consumes one newer agreed epoch, so this count -- not a rank's
    # own round number -- names rounds and attempts identically on every survivor.
    _attempts: int = field(default=0, init=False, repr=False)

    def run(self, iteration: int, ids: Sequence[int]) -> IterationOutcome:
        ids, m = list(ids), self.live
        first_plan = {r: list(q) for r, q in self.replica.plan(ids, m.live_replicas).items()}
        # round-0 owners, never changed
        it = _Progress(iteration, ids, {g: r for r, q in first_plan.items() for g in q})
        todo, kept = first_plan.get(m.replica, []), Totals.of_ids([])
        saved = None  # gradients as of `kept`, taken before each recovery round
        owed: list[int] = []  # this replica's round-0 quota, if its round 0 stopped short
        self._attempts = 0
        for round_ in range(self.max_attempts):
            phase, clock = "refresh", time.perf_counter()
            try:
                self.replica.refresh()
                phase = "execute"
                done = self.replica.execute(todo)  # 2: accumulates on top of `kept`
                local = kept + Totals.of_ids(done.ids, done.tokens, done.loss_sum, done.measures)
                it.seconds["execute"] += time.perf_counter() - clock
                if it.recoveries:
                    it.recoveries[-1].seconds["recompute"] = time.perf_counter() - clock
                phase, clock = "reduce", time.perf_counter()
                reduced = self.replica.reduce(local)  # 3: out of place
                self.replica.check_reduced()
                self.replica.validate(reduced, local, self._assignment(it))
                it.seconds["reduce"] += time.perf_counter() - clock
                phase, clock = "commit", time.perf_counter()
                decision = self._confirm(iteration)  # 4
                it.seconds["commit"] += time.perf_counter() - clock
                phase = "step"
                return self._commit_and_step(it, reduced, decision)  # 5
            except PeerFailure as err:
                if self.agreement is None:
                    raise
                failure = err
            if phase == "step":  # committed; then a member of this replica failed mid-step
                self._interrupted(it, failure)
            decision = self._settle(failure, phase, iteration)
            if decision.committed:  # this rank holds its full sum: it steps with it
                return self._roll_forward(it, reduced, decision, failure, clock)
            if round_ > 0:  # recovery rounds are atomic: undo this one's partial work
                self.replica.restore(saved)
            elif phase not in ("refresh", "execute"):  # round 0 finished on every stage
                kept = local
            # round 0 stopped short of its end on some rank of a live replica (its weights were
            # incomplete, or a wait for them failed mid-forward): the whole replica computes its
            # round-0 quota again, from zero, with its share of the lost ids
            record = self._recover(it, failure, phase,
                                   torn=phase in ("refresh", "execute") if round_ == 0 else None)
            if record.redo:
                self.replica.reset()
                kept, owed = Totals.of_ids([]), first_plan.get(m.replica, [])
            it.replanned = record.replanned
            saved = self.replica.snapshot()
            todo = owed + it.replanned.get(m.replica, [])
            it.recoveries.append(record)
        raise RuntimeError(f"iteration {iteration}: no commit after {self.max_attempts} rounds")

    def _key(self, iteration: int) -> str:
        """The current round's name, the same on every survivor (see `_attempts`)."""
        return f"{iteration}/after{self._attempts}"

    def _confirm(self, iteration: int) -> Decision:
        """4: the ack and the exchange (`settle.py`): no store operation. COMMIT, or
        COMMIT_AND_SYNC if a member saw a newer membership epoch (all meet at the boundary)."""
        if self.agreement is None:
            return Decision.COMMIT
        news = self.replica.confirm(self.agreement.latest_epoch() > self.live.epoch)
        decision = Decision.COMMIT_AND_SYNC if news else Decision.COMMIT
        self.agreement.note_commit(self._key(iteration), decision)
        return decision

    def _settle(self, failure: PeerFailure, phase: str, iteration: int) -> Decision:
        """Report the failure at once, then settle the round through the store: ABORT, or a
        commit this rank joins by rolling forward (it holds its sum: phase "commit")."""
        assert self.agreement is not None  # recovery is on
        if self.on_failure is not None:
            self.on_failure(failure, phase)
        status = SUM if phase == "commit" else NOTHING
        return self.agreement.settle(self._key(iteration), self.live.members(), status)

    def _roll_forward(self, it: _Progress, reduced: ReducedGradients, decision: Decision,
                      failure: PeerFailure, since: float) -> IterationOutcome:
        """The round committed while this rank's ack or exchange failed: it steps with the sum it
        holds, as the ranks that committed did (a member lost mid-step: as in `run`)."""
        record = RecoveryRecord(self._attempts, str(failure), "commit", self.live.epoch, [],
                                [], [], {}, {"detection": time.perf_counter() - since},
                                rolled_forward=True)
        it.recoveries.append(record)
        try:  # the failure that stopped this rank's commit may have aborted a group of the step
            mended = self.replica.mend(self.live.epoch, f"mend/{self._key(it.iteration)}")
            record.groups_rebuilt, record.groups_kept = mended.rebuilt, mended.kept
            return self._commit_and_step(it, reduced, decision)
        except PeerFailure as err:
            self._interrupted(it, err)

    def _interrupted(self, it: _Progress, failure: PeerFailure) -> NoReturn:
        """A step failed after the round committed: recovery ends this rank's replica
        (ReplicaLost), or this rank leaves (StepInterrupted: a step half done is never redone)."""
        if self.on_failure is not None:
            self.on_failure(failure, "step")
        self._recover(it, failure, "step", torn=None)
        raise StepInterrupted(f"iteration {it.iteration}: {failure}")

    def _commit_and_step(self, it: _Progress, reduced: ReducedGradients, decision: Decision
                         ) -> IterationOutcome:
        """Exactly the planned ids were reduced (else stop loudly: a bug), then the step."""
        assignment = self._assignment(it)
        owned = {g for q in assignment.values() for g in q}
        committed = [g for g in it.ids if g in owned]  # the lost ids of --recover-policy drop are not
        check_commit(reduced.totals, committed)
        clock = time.perf_counter()
        report = self.replica.step(reduced)  # 5
        it.seconds["step"] = time.perf_counter() - clock
        return IterationOutcome(it.iteration, committed, assignment, reduced.totals, report,
                                it.seconds, it.recoveries,
                                sync=decision is Decision.COMMIT_AND_SYNC)

    def _assignment(self, it: _Progress) -> dict[int, list[int]]:
        """Each live replica's ids as of this round: its round-0 ones and its re-planned ones."""
        live = self.live.live_replicas
        final = {g: (r if r in live else None) for g, r in it.owner.items()}
        final.update({g: r for r, q in it.replanned.items() for g in q})
        return {r: [g for g in it.ids if final[g] == r] for r in live}

    def _recover(self, it: _Progress, failure: PeerFailure, phase: str, torn: bool | None
                 ) -> RecoveryRecord:
        """Abandon every group, agree on the epoch, meet all survivors, rebuild, re-plan. A
        failure on the way (a newer epoch) just starts the next attempt. `torn` (round 0 only):
        this rank's round 0 stopped short; after the rebuild the replica's ranks agree on it."""
        m = self.live
        self.replica.abandon(phase)
        if torn is not None:  # (asked before the rebuild forgets what broke)
            torn = torn or self.replica.weights_torn()
        timing, regrouped, seen_dead, failure, redo = self._regroup(
            str(it.iteration), failure, lambda: torn is not None and self.replica.replica_any(torn))
        lost = [g for g in it.ids if it.owner[g] not in m.live_replicas]
        replanned = {} if self.drop_lost or not lost else {
            r: list(q) for r, q in self.replica.plan(lost, m.live_replicas).items()}
        return RecoveryRecord(self._attempts, str(failure), phase, m.epoch, sorted(seen_dead),
                              sorted(set(it.owner.values()) - set(m.live_replicas)), lost, replanned,
                              timing, redo, regrouped.rebuilt, regrouped.kept,
                              regrouped.shrunk, regrouped.connect_seconds)

    def regroup(self, label: str, failure: PeerFailure) -> Regrouped:
        """Recovery outside an iteration (a failure during the job's last save, which nothing
        after it would replace): the survivors agree on the epoch, drop the broken replicas
        and re-form their groups, with nothing to recompute. Raises ReplicaLost or
        TooFewReplicas as a recovery inside an iteration does."""
        self.replica.abandon("recovery")
        return self._regroup(label, failure, lambda: False)[1]

    def _regroup(self, label: str, failure: PeerFailure, after_rebuild: Callable[[], bool]
                 ) -> tuple[dict[str, float], Regrouped, set[int], PeerFailure, bool]:
        """The membership part of a recovery, attempt after attempt (each consumes a newer
        agreed epoch): its timings, the groups' fate, the dead seen, the last failure, and what
        `after_rebuild` (a collective of the new groups, or nothing) said."""
        m, clock = self.live, time.perf_counter()
        assert self.agreement is not None  # recovery is on
        timing = {"detection": 0.0, "rebuild": 0.0}
        seen_dead: set[int] = set()  # over all attempts: a grow epoch may clear a dead rank again
        for _ in range(self.max_attempts):
            key = f"{label}/{self._attempts}"
            self._attempts += 1
            try:
                epoch, dead = self.agreement.agree_on_epoch(key, m.epoch)
                seen_dead |= dead
                timing["detection"] += time.perf_counter() - clock
                clock = time.perf_counter()
                m.adopt_epoch(epoch, dead)  # all survivors drop the same replicas
                self.probe.at("recovery")
                self.agreement.barrier(key, m.members(), epoch)
                regrouped = self.replica.rebuild(m.live_replicas, epoch, f"recover/{key}")
                said = after_rebuild()
                timing["rebuild"] += time.perf_counter() - clock
                return timing, regrouped, seen_dead, failure, said
            except PeerFailure as err:  # someone else died during recovery: next attempt
                failure = err
                self.replica.abandon("recovery")
                clock = time.perf_counter()
        raise RuntimeError(f"recovery {label}: did not converge")
