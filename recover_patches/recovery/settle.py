"""How an iteration's commit is decided: by the collectives in a failure-free round, through the
coordinator's store only when a failure interrupted the round (design.md §4 step 4).

A failure-free round touches no store. After its data-parallel reduction a rank

  1. has read the reduction's tail on the host: its full sum is in `reduced` (status SUM);
  2. joins the *ack*, an all-reduce of one integer over its DP group, and waits for it on the host;
  3. joins the *exchange*, an all-reduce of that integer over its replica's group, and waits;
  4. steps: the round is committed (status COMMITTED).

Why this is safe. A rank's exchange returns only if every rank of its replica entered it having
completed its ack (a rank whose ack failed enters it too, so that its replica does not wait for
it there, but with a mark that makes the exchange raise on every rank: `step/commit_vote.py`); an ack completes only if every rank of that DP group
entered it, i.e. completed its reduction. The replica holds one rank at every position, so a
completed exchange anywhere means every rank of the job held its full sum. Conversely, a live
rank that failed before its ack (status NOTHING: it holds no full sum) kept its position's ack
from completing anywhere, so no exchange completed and nobody stepped. So COMMITTED and NOTHING
never both occur in one round; between them, ranks whose ack or exchange failed hold their sum
(SUM) and may share the job with ranks that stepped and went on.

Only an interrupted round uses the store, under `recover/settle/<iteration>/after<attempt>/`:
  * NOTHING decides ABORT at once (a compare_set), then reports its status;
  * COMMITTED -- a rank that stepped and later meets a failure -- decides what its exchange said
    (COMMIT, or COMMIT_AND_SYNC if someone saw a newer epoch) the first time it uses the store;
  * SUM reports and polls: a stored decision wins; once every member not declared dead reported
    SUM, it decides COMMIT_AND_SYNC: every rank of every live replica holds its sum, so the
    round commits by "rolling forward" (each SUM rank steps with the sum it holds) instead of
    recomputing, and everyone meets at the iteration boundary to drop the broken replicas.
A decider reports after deciding, so the SUM pollers' "everyone reported" always sees its
decision. `tests/test_commit_protocol.py` runs these functions over every order of completions,
failures and reports of small jobs. On NCCL, a wait does not block the host: each step above
waits for its result on the host and checks layer 1's latched failures before the next.
"""
from __future__ import annotations

from typing import Iterable

from recover_patches.recovery.decision import Decision

NOTHING, SUM, COMMITTED = "nothing", "sum", "committed"  # what a rank holds when it settles


class SettleViolation(RuntimeError):
    """Two ranks of one round reached opposite decisions: the protocol's argument is broken.
    The job stops (a restart from the last checkpoint) rather than let replicas diverge."""


def prefix_of(key: str) -> str:
    return f"recover/settle/{key}/"


def report(store, key: str, rank: int, status: str, committed: Decision | None = None
           ) -> Decision | None:
    """This rank's status in round `key`; NOTHING and COMMITTED take their decision (returned)
    before the status is visible, SUM takes none (None)."""
    prefix = prefix_of(key)
    decided = None
    mine = {NOTHING: Decision.ABORT, COMMITTED: committed, SUM: None}[status]
    if mine is not None:
        decided = Decision(store.compare_set(prefix + "decision", "", mine.value).decode())
        if decided is not mine:
            raise SettleViolation(f"round {key}: rank {rank} ({status}) needs {mine.value} but "
                                  f"{decided.value} was decided")
    store.set(prefix + f"status/{rank}", status)
    return decided


def poll(store, key: str, members: Iterable[int], dead: Iterable[int]) -> Decision | None:
    """One look at round `key` for a SUM rank: the stored decision, or COMMIT_AND_SYNC once every
    member not declared dead has reported (none of them decided: all hold their sum), else None."""
    prefix = prefix_of(key)
    if store.check([prefix + "decision"]):
        return Decision(store.get(prefix + "decision").decode())
    live = sorted(set(members) - set(dead))
    if store.check([prefix + f"status/{m}" for m in live]):
        return Decision(store.compare_set(prefix + "decision", "",
                                          Decision.COMMIT_AND_SYNC.value).decode())
    return None


def missing(store, key: str, members: Iterable[int], dead: Iterable[int]) -> list[int]:
    """The live members that have not reported in round `key` (for a failure report)."""
    prefix = prefix_of(key)
    return [m for m in sorted(set(members) - set(dead))
            if not store.check([prefix + f"status/{m}"])]
