"""The iteration transaction and its recovery loop, with fakes standing in for the pipeline,
the DP reduction and the store agreement: which ids each round computes, what commits."""
from __future__ import annotations

import pytest

from recover_patches.collectives import Regrouped
from recover_patches.collectives.errors import PeerFailure
from recover_patches.recovery.agreement import Decision
from recover_patches.recovery.iteration import (IterationTransaction, LiveReplicas, ReplicaLost,
                                                StepInterrupted, TooFewReplicas)
from recover_patches.recovery.settle import NOTHING, SUM
from recover_patches.recovery.grad_buffer import ReducedGradients
from recover_patches.recovery.reduce import CommitError, Totals
from recover_patches.pipeline.schedule import ScheduleResult
from recover_patches.workload.policy import even_plan

IDS = list(range(40, 48))  # M = 8
RANKS = {r: [r, r + 4] for r in range(4)}  # 4 replicas of 2 stages (PP = 2)


class FakeJob:
    """Plays one rank of replica `me`; `script` says, per round, what goes wrong and who dies."""

    def __init__(self, me: int, script: dict[int, tuple[str, set[int]]], replicas=4):
        self.me = me
        self.script = script  # round -> (phase that fails, ranks dead in the agreed epoch)
        self.round = 0
        self.executed: list[list[int]] = []
        self.dead: set[int] = set()
        self.rebuilt: list[tuple[list[int], int]] = []
        self.barriers: list[tuple[str, list[int]]] = []
        self.abandoned = 0
        self.restored: list[int] = []
        self.resets = 0
        self.peer_torn = False  # another rank of this replica stopped short in round 0
        self.plans: list[dict[int, list[int]]] = []  # every plan made, round 0 first
        self.extra: list[int] = []  # ids some replica reduced beyond the plans
        self.settled: list[tuple[str, str]] = []  # (round key, status) of every settle
        self.committed: list[tuple[str, Decision]] = []  # note_commit calls
        self.roll_forward = Decision.ABORT  # what settling a SUM rank's round decides
        self.steps = 0
        self.mended: list[tuple[str, int]] = []
        self.torn_weights = False  # an all-gather of this round's weights was cut short
        self.live = LiveReplicas(replica=me, live_replicas=list(range(replicas)), epoch=0,
                                 replica_ranks=lambda r: RANKS[r])

    # transaction parts
    def refresh(self):  # this replica's weights are incomplete (a failed all-gather after a step)
        if self.script.get(self.round, ("", set()))[0] == "refresh":
            raise PeerFailure(self.live.epoch, (), "distopt.param_gather")

    def execute(self, ids):
        self.executed.append(list(ids))
        if self.script.get(self.round, ("", set()))[0] == "execute":
            raise PeerFailure(self.live.epoch, self.script[self.round][1], "tp.allreduce")
        return ScheduleResult(list(ids), loss_sum=float(len(ids)), tokens=10 * len(ids))

    def reduce(self, local: Totals) -> ReducedGradients:
        if self.script.get(self.round, ("", set()))[0] == "reduce":
            raise PeerFailure(self.live.epoch, self.script[self.round][1], "dp.allreduce")
        # the global sum: the live replicas' round-0 shares plus the current recovery plan
        # (an aborted recovery round is undone everywhere)
        rounds = self.plans[:1] + self.plans[1:][-1:]
        all_ids = [g for plan in rounds for r in self.live.live_replicas for g in plan.get(r, [])]
        all_ids += self.extra
        return ReducedGradients(Totals.of_ids(all_ids, 10 * len(all_ids)), [])

    def confirm(self, news):
        if self.script.get(self.round, ("", set()))[0] == "commit":  # the ack or the exchange
            raise PeerFailure(self.live.epoch, self.script[self.round][1], "dp.allreduce")
        return news

    def step(self, reduced):
        self.steps += 1
        return {"loss": reduced.totals.loss_sum}

    def plan(self, ids, replicas):
        plan = even_plan(ids, replicas)
        self.plans.append(plan)  # the fake "other replicas" compute their share too
        return plan

    # agreement
    def latest_epoch(self):
        return 0

    def note_commit(self, key, decision):
        self.committed.append((key, decision))

    def settle(self, key, members, status):
        self.settled.append((key, status))
        return self.roll_forward if status == SUM else Decision.ABORT

    def agree_on_epoch(self, key, since):
        self.dead |= self.script[self.round][1]
        self.round += 1
        return since + 1, frozenset(self.dead)

    def barrier(self, key, members, epoch):
        self.barriers.append((key, sorted(members)))

    def rebuild(self, live, epoch, key=""):
        self.rebuilt.append((list(live), epoch))
        return Regrouped(rebuilt=["dp"], kept=["tp"])

    def abandon(self, phase="execute"):
        self.abandoned += 1

    def weights_torn(self):
        return self.torn_weights

    def mend(self, epoch, key):
        self.mended.append((key, self.steps))  # with the steps taken before it
        return Regrouped(rebuilt=["replica"], kept=["tp"])

    def reset(self):
        self.resets += 1

    def replica_any(self, flag):
        return flag or self.peer_torn

    def check_reduced(self):
        pass

    def validate(self, reduced, local, assignment):
        pass

    def snapshot(self):
        return len(self.executed)

    def restore(self, state):
        self.restored.append(state)

    def transaction(self, drop=False) -> IterationTransaction:
        return IterationTransaction(live=self.live, replica=self, agreement=self, drop_lost=drop)


def test_failure_free_iteration_commits_its_share():
    job = FakeJob(me=1, script={})
    out = job.transaction().run(6, IDS)
    assert job.executed == [[42, 43]]
    assert out.ids == IDS and out.totals.microbatches == 8 and out.recoveries == []
    # committed by the collectives alone: noted for a later failure, nothing settled
    assert job.committed == [("6/after0", Decision.COMMIT)] and job.settled == []


def test_lost_ids_only_are_recomputed_by_survivors():
    job = FakeJob(me=0, script={0: ("reduce", {2})})  # replica 2's stage-0 rank died
    out = job.transaction().run(6, IDS)
    # round 0: own share; round 1: only replica 2's ids [44, 45], spread over replicas 0, 1, 3
    assert job.executed == [[40, 41], [44]]
    assert out.totals.microbatches == 8 and out.ids == IDS
    rec = out.recoveries[0]
    assert rec.lost_replicas == [2] and rec.lost_ids == [44, 45]
    assert rec.replanned == {0: [44], 1: [45], 3: []}
    assert job.rebuilt == [([0, 1, 3], 1)] and job.live.live_replicas == [0, 1, 3]
    assert job.abandoned == 1 and job.barriers == [("6/0", [0, 1, 3, 4, 5, 7])]
    assert job.restored == []  # round 0's work is kept
    assert out.assignment == {0: [40, 41, 44], 1: [42, 43, 45], 3: [46, 47]}


def test_failure_during_recovery_starts_another_round():
    job = FakeJob(me=3, script={0: ("reduce", {1}), 1: ("reduce", {4})})  # then replica 0 dies
    out = job.transaction().run(6, IDS)
    assert [r.lost_replicas for r in out.recoveries] == [[1], [0, 1]]
    # round 1 replans [42, 43] over 0, 2, 3 (replica 3 gets nothing) and fails; recovery rounds
    # are atomic, so round 2 replans *all* ids of dead round-0 owners, [40..43], over 2 and 3
    assert job.executed == [[46, 47], [], [42, 43]]
    assert job.restored == [1]  # round 1's partial work undone (snapshot taken after round 0)
    assert out.recoveries[1].replanned == {2: [40, 41], 3: [42, 43]}
    assert out.totals.microbatches == 8 and job.live.live_replicas == [2, 3]
    assert out.assignment == {2: [40, 41, 44, 45], 3: [42, 43, 46, 47]}


def test_survivor_of_a_broken_replica_leaves():
    job = FakeJob(me=2, script={0: ("execute", {6})})  # its own stage-1 peer died
    with pytest.raises(ReplicaLost):
        job.transaction().run(6, IDS)


def test_too_few_replicas_stops():
    job = FakeJob(me=0, script={0: ("reduce", {1, 2, 3})})
    job.live.min_replicas = 2
    with pytest.raises(TooFewReplicas):
        job.transaction().run(6, IDS)


def test_drop_policy_skips_lost_ids_and_commits_the_rest():
    job = FakeJob(me=0, script={0: ("reduce", {5})})
    out = job.transaction(drop=True).run(6, IDS)
    assert job.executed == [[40, 41], []]
    assert out.ids == [40, 41, 44, 45, 46, 47] and out.totals.microbatches == 6


def test_a_reduction_missing_an_id_is_a_bug_not_a_failure():
    job = FakeJob(me=0, script={})
    job.extra = [43]  # some replica reduced microbatch 43 twice
    with pytest.raises(CommitError):
        job.transaction().run(6, IDS)


def test_without_agreement_a_failure_propagates():
    job = FakeJob(me=0, script={0: ("reduce", {1})})
    tx = job.transaction()
    tx.agreement = None
    with pytest.raises(PeerFailure):
        tx.run(6, IDS)


def test_a_failure_latched_after_the_reduction_returned_aborts_the_commit():
    # NCCL: the reduction's wait() returned, then the watchdog latched that it never ended
    job = FakeJob(me=0, script={0: ("latched", {2})})

    def check_reduced():
        if job.round == 0:
            raise PeerFailure(0, {2}, "dp.allreduce", "no completion within the deadline")
    tx = job.transaction()
    job.check_reduced = check_reduced
    out = tx.run(6, IDS)
    assert job.settled[0] == ("6/after0", NOTHING)  # holds no sum: aborts for everyone
    assert out.recoveries[0].phase == "reduce" and out.recoveries[0].lost_replicas == [2]
    assert out.totals.microbatches == 8 and out.ids == IDS


@pytest.mark.parametrize("decided", [Decision.COMMIT, Decision.COMMIT_AND_SYNC])
def test_a_rank_whose_ack_failed_after_the_round_committed_elsewhere_rolls_forward(decided):
    """Settle says the round committed (another rank's exchange completed): this rank holds its
    full sum, so it steps with it -- no recovery round, no recomputation, the decision's sync."""
    job = FakeJob(me=1, script={0: ("commit", {2})})
    job.roll_forward = decided
    out = job.transaction().run(6, IDS)
    assert job.settled == [("6/after0", SUM)] and job.steps == 1
    assert job.executed == [[42, 43]] and job.rebuilt == [] and job.abandoned == 0
    # before the step, the replica's own groups are made whole (the failure may have aborted
    # one on some member: on the emulated NCCL a (2,1,2) job's replica group, and both its
    # ranks stopped in the step)
    assert job.mended == [("mend/6/after0", 0)]
    (record,) = out.recoveries
    assert record.rolled_forward and record.phase == "commit" and record.lost_ids == []
    assert record.groups_rebuilt == ["replica"] and record.groups_kept == ["tp"]
    assert out.ids == IDS and out.totals.microbatches == 8
    assert out.sync is (decided is Decision.COMMIT_AND_SYNC)


def test_a_replica_that_computed_on_torn_weights_computes_its_round_again_from_zero():
    """The distributed optimizer's weight all-gather, cut short by the death that the reduction
    then meets: on NCCL the forward ran on what the abort left. The replica's round 0 is
    computed again with its share of the lost ids, not kept (emulated K = 2: losses drifted
    1.2e-2 from the failure-free run). Control: intact weights keep round 0."""
    for torn, executed, resets in ((True, [[40, 41], [40, 41, 44]], 1),
                                   (False, [[40, 41], [44]], 0)):
        job = FakeJob(me=0, script={0: ("reduce", {2})})
        job.torn_weights = torn
        out = job.transaction().run(6, IDS)
        assert job.executed == executed and job.resets == resets
        assert out.recoveries[0].redo is torn and out.ids == IDS


def test_a_rank_whose_ack_failed_in_an_aborted_round_recovers_keeping_its_work():
    job = FakeJob(me=0, script={0: ("commit", {2})})  # settle: ABORT (someone held nothing)
    out = job.transaction().run(6, IDS)
    assert job.settled == [("6/after0", SUM)] and job.steps == 1
    assert job.executed == [[40, 41], [44]]  # round 0 kept, then a share of replica 2's ids
    assert out.recoveries[0].phase == "commit" and not out.recoveries[0].rolled_forward
    assert out.ids == IDS and out.totals.microbatches == 8


def test_a_rejected_result_is_recovered_like_a_failure_and_validation_sees_the_plan():
    # --rerun-mode: validation after the reduction rejected replica 2's result (it is fenced,
    # the coordinator declares it dead): its ids are recomputed, nobody else's
    job = FakeJob(me=0, script={0: ("latched", {2})})
    seen: list[dict] = []

    def validate(reduced, local, assignment):
        seen.append({r: list(q) for r, q in assignment.items()})
        if job.round == 0:
            raise PeerFailure(0, {2}, "rerun.validate", "a result was rejected")
    tx = job.transaction()
    job.validate = validate
    out = tx.run(6, IDS)
    assert sorted(g for q in seen[0].values() for g in q) == IDS  # every id, once, by owner
    assert out.recoveries[0].phase == "reduce" and out.recoveries[0].lost_replicas == [2]
    assert out.recoveries[0].lost_ids == seen[0][2] and 2 not in seen[-1]
    assert out.totals.microbatches == 8 and out.ids == IDS


@pytest.mark.parametrize("dead, raised", [({4}, ReplicaLost), ({2}, StepInterrupted)])
def test_a_failure_inside_the_step_is_never_settled_and_the_step_never_redone(dead, raised):
    """The exchange committed the round before the step: a collective failing inside it (a
    member of this replica died: ReplicaLost) settles nothing, and a replica that stays live
    cannot redo a step half done, so the job stops (StepInterrupted)."""
    job = FakeJob(me=0, script={})

    def step(reduced):
        job.steps += 1
        job.script[job.round] = ("", dead)  # the epoch that follows declares them dead
        raise PeerFailure(0, dead, "replica.allreduce")
    tx = job.transaction()
    job.step = step
    with pytest.raises(raised):
        tx.run(6, IDS)
    assert job.committed == [("6/after0", Decision.COMMIT)] and job.settled == []
    assert job.steps == 1 and job.executed == [[40, 41]]


def test_a_replica_with_incomplete_weights_computes_its_quota_after_recovery():
    # replica 1 died in the distributed optimizer's all-gather after iteration 5's step: replica
    # 0's weights miss its slice, so it computes nothing until the rebuild has re-sharded
    job = FakeJob(me=0, script={0: ("refresh", {1})})
    out = job.transaction().run(6, IDS)
    assert job.executed == [[40, 41, 42]]  # its own round-0 quota, then its share of replica 1's
    assert out.recoveries[0].phase == "refresh" and out.recoveries[0].lost_ids == [42, 43]
    assert out.ids == IDS and out.totals.microbatches == 8
    assert out.assignment == {0: [40, 41, 42], 2: [43, 44, 45], 3: [46, 47]}


def test_the_owed_quota_survives_a_failure_in_the_recovery_round():
    job = FakeJob(me=0, script={0: ("refresh", {1}), 1: ("reduce", {2})})
    out = job.transaction().run(6, IDS)
    # round 2 replans the ids of both dead round-0 owners over replicas 0 and 3; replica 0 still
    # owes its own round-0 quota, which the aborted round 1 had computed and then undone
    assert job.executed == [[40, 41, 42], [40, 41, 42, 43]]
    assert job.restored == [0]
    assert out.ids == IDS and out.totals.microbatches == 8
    assert out.assignment == {0: [40, 41, 42, 43], 3: [44, 45, 46, 47]}


def test_a_live_replica_cut_short_mid_forward_computes_its_quota_again():
    # a wait for this replica's overlapped weight all-gather failed during its first forward
    # (replica 1 died in the gather): round 0 is redone from zero gradients, not raised
    job = FakeJob(me=0, script={0: ("execute", {1})})
    out = job.transaction().run(6, IDS)
    assert job.executed == [[40, 41], [40, 41, 42]] and job.resets == 1
    assert out.recoveries[0].redo and out.ids == IDS and out.totals.microbatches == 8


def test_a_rank_whose_replica_mate_was_cut_short_redoes_round_0_with_it():
    job = FakeJob(me=0, script={0: ("reduce", {2})})
    job.peer_torn = True  # this rank finished round 0, its pipeline peer did not
    out = job.transaction().run(6, IDS)
    assert job.executed == [[40, 41], [40, 41, 44]] and job.resets == 1
    assert out.assignment[0] == [40, 41, 44]
