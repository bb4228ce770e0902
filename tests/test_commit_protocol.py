"""The commit protocol of `recover_patches/recovery/settle.py`, checked exhaustively on
small jobs -- every way a round's three collectives can end on every rank, every point at which
one or two ranks can die, and every order in which the survivors (and the dead, before dying)
report and the coordinator declares the dead -- with the real `settle.report` and `settle.poll`
on a store that behaves like TCPStore.

A job is R replicas x P positions. Each rank runs the reduction (over its position's DP group),
the ack (same group), the exchange (over its replica) and then steps. A collective that every
member entered may complete or fail on each live participant independently (a death after
entering, an abort, a false timeout: the strongest adversary); one that some member never entered
completes nowhere. A live rank may also fail before the reduction (its execute failed).
Checked: all survivors reach one decision; a commit leaves every rank of every live replica
holding its full sum or stepped; an abort leaves no survivor stepped.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from recover_patches.recovery import settle
from recover_patches.recovery.decision import Decision

ROUND = ("dp", "dp", "replica")  # the groups of the reduction, the ack, the exchange
STAGES = len(ROUND)
# how far a rank that dies got: it entered stages < ceil(point / 2), completed stages < point // 2
DEATH_POINTS = range(2 * STAGES + 1)  # 0: entered nothing ... 6: stepped, then died


class Store:
    """TCPStore's semantics for the operations settle uses; `between` runs after every write
    (the other ranks' polls may come between two operations of one rank)."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.between = lambda: None

    def set(self, key, value):
        self.data[key] = value
        self.between()

    def get(self, key):
        return self.data[key].encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def compare_set(self, key, expected, desired):
        if self.data.get(key, "") == expected:
            self.data[key] = desired
        value = self.data[key].encode()
        self.between()
        return value


@dataclass(frozen=True)
class Job:
    replicas: int
    positions: int

    @property
    def ranks(self) -> range:
        return range(self.replicas * self.positions)

    def replica_of(self, rank: int) -> int:
        return rank // self.positions

    def groups(self, kind: str) -> list[list[int]]:
        if kind == "dp":  # one group per position
            return [[r * self.positions + p for r in range(self.replicas)]
                    for p in range(self.positions)]
        return [[r * self.positions + p for p in range(self.positions)]
                for r in range(self.replicas)]


def status_after(completed: int, stages: int) -> str:
    """What a rank holds having completed that many of `stages` (-1: it failed before the
    first): nothing until its reduction completed, its sum until it completed them all."""
    if completed <= 0:
        return settle.NOTHING
    return settle.COMMITTED if completed == stages else settle.SUM


def endings(job: Job, deaths: dict[int, int], stages: tuple[str, ...] = ROUND):
    """Every status a round of `stages` can leave on each live rank: yields {rank: status}."""
    live = [r for r in job.ranks if r not in deaths]

    def entered(rank: int, stage: int, done: dict[int, int]) -> bool:
        if rank in deaths:
            return deaths[rank] >= 2 * stage + 1
        return done[rank] >= stage

    def walk(stage: int, done: dict[int, int]):
        if stage == len(stages):
            yield {r: status_after(done[r], len(stages)) for r in live}
            return
        choices = []  # per group: the live entrants, and whether the group can complete
        for group in job.groups(stages[stage]):
            entrants = [r for r in group if r not in deaths and entered(r, stage, done)]
            complete = all(entered(r, stage, done) for r in group)
            if not complete and any(deaths.get(r, 0) >= 2 * stage + 2 for r in group):
                return  # a dead rank cannot have completed what its group could not
            choices.append((entrants, complete))
        movers = [r for entrants, complete in choices if complete for r in entrants]
        for bits in itertools.product((False, True), repeat=len(movers)):
            nxt = dict(done)
            for rank, completed in zip(movers, bits):
                nxt[rank] = stage + 1 if completed else stage
            yield from walk(stage + 1, nxt)

    for failed_early in itertools.product((False, True), repeat=len(live)):
        # done[r]: stages completed; a live rank failing in execute never enters the reduction
        start = {r: (-1 if early else 0) for r, early in zip(live, failed_early)}
        yield from walk(0, start)


def dead_reports(point: int) -> list[str | None]:
    """What a rank that died at `point` may have reported before dying (None: nothing)."""
    if point == 2 * STAGES:
        return [None, settle.COMMITTED]  # it stepped, met a failure later, reported, died
    if point <= 2:
        return [None, settle.NOTHING]  # it failed before its ack and reported, or just died
    return [None, settle.SUM]


def run_order(job: Job, statuses: dict[int, str], dead: dict[int, str | None],
              order: tuple) -> dict[int, Decision]:
    """Play one order of events on a fresh store; returns each survivor's decision."""
    store, key, members = Store(), "7/after0", list(job.ranks)
    declared: set[int] = set()
    decided: dict[int, Decision] = {}
    waiting: list[int] = []
    polling = [False]

    def poll_all():  # every waiting SUM rank polls after every event and every write
        if polling[0]:
            return
        polling[0] = True
        for rank in list(waiting):
            got = settle.poll(store, key, members, declared)
            if got is not None:
                decided[rank] = got
                waiting.remove(rank)
        polling[0] = False
    store.between = poll_all
    for kind, rank in order:
        if kind == "declare":
            declared.add(rank)
        else:
            status = statuses.get(rank) or dead[rank]
            mine = settle.report(store, key, rank, status, Decision.COMMIT)
            if rank in statuses:
                if mine is None:
                    waiting.append(rank)
                else:
                    decided[rank] = mine
        poll_all()
    assert not waiting, f"undecided after every report and declaration: {waiting}"
    return decided


def events(statuses: dict[int, str], dead: dict[int, str | None]) -> list[tuple]:
    """Every order of the survivors' reports and the dead ranks' reports and declarations (a dead
    rank reports, if at all, before it is declared)."""
    items = [("report", r) for r in statuses] + [("declare", r) for r in dead]
    items += [("report", r) for r, status in dead.items() if status is not None]
    orders = []
    for order in itertools.permutations(items):
        at = {item: i for i, item in enumerate(order)}
        if all(at[("report", r)] < at[("declare", r)] for r, s in dead.items() if s is not None):
            orders.append(order)
    return orders


def check(job: Job, statuses: dict[int, str], deaths: dict[int, int],
          decisions: dict[int, Decision]) -> None:
    if not statuses:
        return  # nobody survived
    (decision,) = set(decisions.values())  # one decision on every survivor
    broken = {job.replica_of(r) for r in deaths}
    live_ranks = [r for r in statuses if job.replica_of(r) not in broken]
    if decision.committed:  # every rank of a live replica steps: it holds its sum, or stepped
        assert all(statuses[r] != settle.NOTHING for r in live_ranks), statuses
    else:
        assert settle.COMMITTED not in statuses.values(), statuses


def scenarios(job: Job, most_deaths: int):
    seen = set()
    for count in range(most_deaths + 1):
        for victims in itertools.combinations(job.ranks, count):
            for points in itertools.product(DEATH_POINTS, repeat=count):
                deaths = dict(zip(victims, points))
                for statuses in endings(job, deaths):
                    for reports in itertools.product(*(dead_reports(p) for p in points)):
                        dead = dict(zip(victims, reports))
                        signature = (tuple(sorted(statuses.items())), tuple(sorted(deaths.items())),
                                     tuple(sorted(dead.items(), key=str)))
                        if signature not in seen:
                            seen.add(signature)
                            yield statuses, deaths, dead


@pytest.mark.parametrize("job, most_deaths", [(Job(2, 1), 2), (Job(3, 1), 2), (Job(2, 2), 2)], ids=str)
def test_every_survivor_reaches_one_valid_decision(job, most_deaths):
    played = 0
    for statuses, deaths, dead in scenarios(job, most_deaths):
        if settle.COMMITTED in statuses.values() and settle.NOTHING in statuses.values():
            pytest.fail(f"the collectives let one rank step while another held nothing: {statuses}")
        for order in events(statuses, dead):
            check(job, statuses, deaths, run_order(job, statuses, dead, order))
            played += 1
    assert played > 500  # the enumeration ran


def test_without_the_ack_a_step_and_a_rank_holding_nothing_coexist():
    """Negative control of the argument: with the exchange straight after the reduction, one
    replica steps while a live rank of another holds nothing."""
    unsafe = [s for s in endings(Job(2, 2), {}, stages=("dp", "replica"))
              if settle.COMMITTED in s.values() and settle.NOTHING in s.values()]
    assert unsafe


def test_a_decider_holding_nothing_after_a_commit_stops_the_job():
    """Were the argument wrong, opposite decisions must stop the job, never both be taken."""
    store = Store()
    assert settle.report(store, "k", 0, settle.COMMITTED, Decision.COMMIT) is Decision.COMMIT
    with pytest.raises(settle.SettleViolation):
        settle.report(store, "k", 1, settle.NOTHING)
