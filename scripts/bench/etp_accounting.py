"""Accounting of the effective-throughput benchmark: which processed iterations are committed.

An *attempt* is one launch of the job; a checkpoint-restart (or a ReCoVer run that ran out of
replicas) relaunches from the latest checkpoint, so the next attempt's `resumed_from` cuts the
previous attempt: its iterations after that checkpoint were processed but are not part of the
final trajectory. Committed = the iterations of the final trajectory, each taken from the last
attempt that ran it. Pure functions over plain data, so they are unit-tested without processes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


class TrajectoryError(AssertionError):
    """The committed iterations do not form one unbroken trajectory (a benchmark or trainer bug)."""


@dataclass
class Record:
    """One iteration as the job's metrics file reported it, stamped when the benchmark saw it."""
    iteration: int
    tokens: int
    microbatches: int
    id_sum: int
    lm_loss: float
    seen_at: float                       # seconds since the arm started
    seconds: float = 0.0                 # the trainer's own time for the iteration
    recovery_seconds: list[float] = field(default_factory=list)  # one total per recovery round
    # False: the job committed this iteration (a later one followed in the same launch) but its
    # metrics record is missing - the logging rank was killed between commit and write. Its
    # tokens are taken from the next record; its batch cannot be checked.
    reported: bool = True


@dataclass
class Kill:
    at: float        # seconds since the arm started
    rank: int
    attempt: int     # index of the attempt it hit


@dataclass
class Attempt:
    started_at: float
    resumed_from: int                    # checkpoint iteration loaded; 0 = from scratch
    records: list[Record] = field(default_factory=list)
    ended_at: float | None = None
    exit_code: int | None = None         # None: stopped by the benchmark at the end of the budget
    first_record_at: float | None = None


def record_from_metrics(rec: dict, seen_at: float) -> Record:
    totals = [sum(r["seconds"].values()) for r in rec.get("recoveries", [])]
    return Record(iteration=rec["iteration"], tokens=rec["tokens"], microbatches=rec["microbatches"],
                  id_sum=rec["id_sum"], lm_loss=rec["lm_loss"], seen_at=seen_at,
                  seconds=rec.get("ms_per_iteration", 0.0) / 1000.0, recovery_seconds=totals)


def unreported_gap(previous: Record | None, resumed_from: int, rec: Record) -> list[Record]:
    """Stand-ins for the iterations between the previous record (or the resume point) and rec."""
    start = (previous.iteration if previous else resumed_from) + 1
    return [Record(iteration=i, tokens=rec.tokens, microbatches=-1, id_sum=-1, lm_loss=rec.lm_loss,
                   seen_at=rec.seen_at, reported=False) for i in range(start, rec.iteration)]


def committed_records(attempts: list[Attempt]) -> list[Record]:
    """The final trajectory: attempt k keeps its iterations up to where attempt k+1 resumed."""
    committed: list[Record] = []
    for k, attempt in enumerate(attempts):
        cutoff = attempts[k + 1].resumed_from if k + 1 < len(attempts) else None
        # an earlier attempt's iterations past a later resume point are superseded
        committed = [r for r in committed if r.iteration <= attempt.resumed_from]
        committed += [r for r in attempt.records if cutoff is None or r.iteration <= cutoff]
    return committed


def processed_tokens(attempts: list[Attempt]) -> int:
    return sum(r.tokens for a in attempts for r in a.records)


def expected_id_sum(iteration: int, microbatches_per_iteration: int) -> int:
    m = microbatches_per_iteration
    return sum(range((iteration - 1) * m, iteration * m))


def check_trajectory(attempts: list[Attempt], microbatches_per_iteration: int,
                     full_batches: bool) -> list[Record]:
    """Raise TrajectoryError unless the committed iterations are 1..N with none missing or doubled,
    each attempt resumed from an iteration an earlier attempt had reached, and (full_batches)
    every committed iteration processed exactly its M planned microbatches. Returns them."""
    reached = 0
    for k, attempt in enumerate(attempts):
        if attempt.resumed_from > reached:
            raise TrajectoryError(f"attempt {k} resumed from iteration {attempt.resumed_from}, "
                                  f"but earlier attempts only reached {reached}")
        iterations = [r.iteration for r in attempt.records]
        want = list(range(attempt.resumed_from + 1, attempt.resumed_from + 1 + len(iterations)))
        if iterations != want:
            raise TrajectoryError(f"attempt {k} ran iterations {iterations[:5]}..., expected {want[:5]}...")
        reached = max(reached, attempt.resumed_from + len(iterations))
    committed = committed_records(attempts)
    if [r.iteration for r in committed] != list(range(1, len(committed) + 1)):
        raise TrajectoryError("committed iterations are not 1..N: "
                              f"{[r.iteration for r in committed][:20]}")
    m = microbatches_per_iteration
    for r in committed:
        if not r.reported:
            continue
        if r.microbatches > m:
            raise TrajectoryError(f"iteration {r.iteration} processed {r.microbatches} > M={m} microbatches")
        if full_batches and (r.microbatches != m or r.id_sum != expected_id_sum(r.iteration, m)):
            raise TrajectoryError(f"iteration {r.iteration} did not process exactly its {m} planned "
                                  f"microbatches ({r.microbatches}, id sum {r.id_sum})")
    return committed


def committed_curve(attempts: list[Attempt]) -> tuple[list[float], list[int]]:
    """(seconds, cumulative committed tokens) at the moments committed iterations were seen."""
    times, tokens, total = [0.0], [0], 0
    for r in committed_records(attempts):
        total += r.tokens
        times.append(r.seen_at)
        tokens.append(total)
    return times, tokens


def attempts_to_json(attempts: list[Attempt]) -> list[dict]:
    return [asdict(a) for a in attempts]


def attempts_from_json(items: list[dict]) -> list[Attempt]:
    out = []
    for item in items:
        records = [Record(**r) for r in item["records"]]
        out.append(Attempt(**{**item, "records": records}))
    return out
