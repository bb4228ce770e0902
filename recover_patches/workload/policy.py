"""Layer 3: which live replica computes which microbatch ids (design.md §7).

Every rank calls :func:`plan` with the same inputs (membership epoch + published timings) and must get
the same answer, so everything here is pure, integer-exact where it can be, and free of set/dict
iteration order: replicas are always taken in ascending replica id ("replica order").

Cost model (1F1B pipeline of depth P): a replica that runs q > 0 microbatches at t seconds each finishes
after (q + P - 1) * t; a replica with q = 0 does nothing and finishes at 0. The plan minimises the
largest finish time over the replicas.

Interleaved pipeline (V > 1 model chunks per rank, groups of G microbatches): the finish time is
the interleaved schedule's own, simulated with unit costs by `recover_patches.pipeline.interleaved.makespan`
for the group size the schedule picks (`best_group`): one microbatch is 3 * V units of one rank's
work, so f(q) = makespan(q) / (3 V) * t, made non-decreasing by a running maximum (the simulation
need not be). From q = P on the simulation gives exactly q + (P - 1) / V (Megatron's bubble over
V), which `finish_factor` then uses directly; shorter lists pay more.

Why greedy is exact: f_r(k) = (k + P - 1) * t_r is non-decreasing in k, so any quota vector q "uses" the
values f_r(1..q_r) of each replica, N = sum(q_r) values in total, and its finish time max_r f_r(q_r) is
at least the N-th smallest of the multiset {f_r(k)}. Giving ids one at a time to the replica whose next
finish time f_r(q_r + 1) is smallest takes exactly the N smallest values of that multiset, so it reaches
that lower bound. Ties (equal floats) go to the lowest replica id, which makes the result deterministic
and turns equal timings into the even split of :func:`even_plan`.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

from recover_patches.pipeline.interleaved import best_group, makespan


class PlanInputError(ValueError):
    """The inputs to a plan are inconsistent (a caller bug, not a runtime failure)."""


def _check_ids(ids: Sequence[int]) -> list[int]:
    ids = list(ids)
    if len(set(ids)) != len(ids):
        raise PlanInputError("microbatch ids must be unique: each id is computed exactly once")
    return ids


def _check_replicas(replicas: Sequence[int], ids: list[int]) -> list[int]:
    order = sorted(replicas)
    if len(set(order)) != len(order):
        raise PlanInputError(f"replica ids must be unique, got {list(replicas)}")
    if ids and not order:
        raise PlanInputError(f"no live replica left to place {len(ids)} microbatch ids")
    return order


def _check_depth(pipeline_depth: int) -> None:
    if isinstance(pipeline_depth, bool) or not isinstance(pipeline_depth, int) or pipeline_depth < 1:
        raise PlanInputError(f"pipeline_depth must be an integer >= 1, got {pipeline_depth!r}")


def _known_time(time_per_microbatch: Mapping[int, float | None], replica: int) -> float | None:
    """A replica's timing, None when unknown; invalid numbers are a caller bug."""
    value = time_per_microbatch.get(replica)
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise PlanInputError(f"time per microbatch of replica {replica} must be finite and > 0, got {value}")
    return value


def _finish_time(quota: int, seconds: float, pipeline_depth: int, chunks: int = 1,
                 group: int = 0) -> float:
    # The single place the cost model is evaluated: plan() and predicted_time() must agree bit for bit.
    return 0.0 if quota == 0 else finish_factor(quota, pipeline_depth, chunks, group) * seconds


def finish_factor(quota: int, pipeline_depth: int, chunks: int = 1, group: int = 0) -> float:
    """Finish time in microbatch times: 1F1B's q + P - 1; interleaved, the simulated schedule's
    below P and q + (P - 1) / V from P on, which is what the simulation gives there (tested for
    P 2-8, V 2-3, groups P to 2P, q up to 4P + 2) at no cost for large quotas: simulating every
    length up to q would take minutes for a thousand microbatches. `group` 0 means P."""
    if quota == 0:
        return 0.0
    if chunks == 1:
        return float(quota + pipeline_depth - 1)
    if quota >= pipeline_depth:
        return quota + (pipeline_depth - 1) / chunks
    return _short_list_units(quota, pipeline_depth, chunks, group or pipeline_depth) / (3 * chunks)


@functools.lru_cache(maxsize=1024)
def _short_list_units(quota: int, stages: int, chunks: int, group: int) -> int:
    return max(makespan(k, stages, chunks, best_group(k, stages, chunks, group))
               for k in range(1, quota + 1))


def _blocks(ids: list[int], order: list[int], quotas: Mapping[int, int]) -> dict[int, list[int]]:
    """Cut ids into contiguous blocks, one per replica in replica order."""
    plan_: dict[int, list[int]] = {}
    start = 0
    for replica in order:
        plan_[replica] = ids[start:start + quotas[replica]]
        start += quotas[replica]
    assert start == len(ids), "quotas must cover every id"
    return plan_


def even_quotas(count: int, replicas: Sequence[int]) -> dict[int, int]:
    """As even as possible; the remainder goes to the lowest replica ids."""
    order = sorted(replicas)
    base, extra = divmod(count, len(order)) if order else (0, 0)
    return {replica: base + (1 if rank < extra else 0) for rank, replica in enumerate(order)}


def even_plan(ids: Sequence[int], replicas: Sequence[int]) -> dict[int, list[int]]:
    """The failure-free default: contiguous blocks, as even as possible, in replica order."""
    ids = _check_ids(ids)
    order = _check_replicas(replicas, ids)
    return _blocks(ids, order, even_quotas(len(ids), order))


def optimal_quotas(count: int, times: Mapping[int, float], pipeline_depth: int, chunks: int = 1,
                   group: int = 0) -> dict[int, int]:
    """Integer quotas summing to count that minimise max_r finish time (greedy, see module doc)."""
    order = sorted(times)
    quotas = {replica: 0 for replica in order}
    # Heap entries (finish time if given one more id, replica order index): the index breaks float ties.
    heap = [(_finish_time(1, times[r], pipeline_depth, chunks, group), index) for index, r in enumerate(order)]
    heapq.heapify(heap)
    for _ in range(count):
        _, index = heapq.heappop(heap)
        replica = order[index]
        quotas[replica] += 1
        heapq.heappush(heap, (_finish_time(quotas[replica] + 1, times[replica], pipeline_depth,
                                               chunks, group), index))
    return quotas


def plan(ids: Sequence[int], replicas: Sequence[int], time_per_microbatch: Mapping[int, float | None],
         pipeline_depth: int, chunks: int = 1, group: int = 0) -> dict[int, list[int]]:
    """Map microbatch ids (kept in the given order) to live replicas as contiguous blocks.

    Returns {replica: ids it computes} for every live replica (an empty list when its quota is 0).
    If any live replica has no known timing (None or missing), all are treated as equal: even split.
    Raises PlanInputError (a ValueError) on duplicate ids/replicas, ids with no replica left, a bad
    pipeline depth, or a non-positive / non-finite timing.
    """
    ids = _check_ids(ids)
    order = _check_replicas(replicas, ids)
    _check_depth(pipeline_depth)
    times = {replica: _known_time(time_per_microbatch, replica) for replica in order}
    known = {replica: seconds for replica, seconds in times.items() if seconds is not None}
    if len(known) < len(times):
        quotas = even_quotas(len(ids), order)
    else:
        quotas = optimal_quotas(len(ids), known, pipeline_depth, chunks, group)
    return _blocks(ids, order, quotas)


def predicted_time(quotas: Mapping[int, int], time_per_microbatch: Mapping[int, float | None],
                   pipeline_depth: int, chunks: int = 1, group: int = 0) -> float:
    """Predicted iteration time max_r f(q_r) * t_r (1F1B: f(q) = q + P - 1), q_r = 0 counting 0."""
    _check_depth(pipeline_depth)
    worst = 0.0
    for replica in sorted(quotas):
        quota = quotas[replica]
        if quota < 0:
            raise PlanInputError(f"quota of replica {replica} must be >= 0, got {quota}")
        if quota == 0:
            continue
        seconds = _known_time(time_per_microbatch, replica)
        if seconds is None:
            raise PlanInputError(f"replica {replica} has {quota} microbatches but no known timing")
        worst = max(worst, _finish_time(quota, seconds, pipeline_depth, chunks, group))
    return worst


def quotas_of(plan_: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Quota per replica of a plan (convenience for predicted_time)."""
    return {replica: len(block) for replica, block in plan_.items()}


def stable_plan(ids: Sequence[int], replicas: Sequence[int],
                time_per_microbatch: Mapping[int, float | None], pipeline_depth: int,
                min_gain: float = 0.05, chunks: int = 1, group: int = 0) -> dict[int, list[int]]:
    """The even plan unless the throughput-aware plan is predicted to be at least `min_gain`
    faster. Equal replicas thus keep the failure-free assignment (and its reduction order, so a
    resumed run stays bitwise identical); only a real imbalance moves work."""
    even = even_plan(ids, replicas)
    times = {r: _known_time(time_per_microbatch, r) for r in _check_replicas(replicas, list(ids))}
    if any(t is None for t in times.values()):
        return even
    best = plan(ids, replicas, time_per_microbatch, pipeline_depth, chunks, group)
    t_even = predicted_time(quotas_of(even), time_per_microbatch, pipeline_depth, chunks, group)
    t_best = predicted_time(quotas_of(best), time_per_microbatch, pipeline_depth, chunks, group)
    return best if t_best < (1.0 - min_gain) * t_even else even


def unit_plan(ids: Sequence[int], replicas: Sequence[int], ep: int,
              place: Callable[[Sequence[int], Sequence[int]], Mapping[int, Sequence[int]]]
              ) -> dict[int, list[int]]:
    """Expert parallelism: the EP replicas of a unit run every microbatch's experts
    together, so `place(ids, units)` places the ids on the live units (each named by its first
    replica), and each unit's block is split over its replicas as evenly as possible (contiguous,
    in replica order). Their quotas then differ by at most one; the short ones pad (`execute`)."""
    if ep == 1:
        return {r: list(q) for r, q in place(ids, replicas).items()}
    order = _check_replicas(replicas, list(ids))
    leaders = sorted({r // ep * ep for r in order})
    if sorted(order) != [r for u in leaders for r in range(u, u + ep)]:
        raise PlanInputError(f"live replicas {order} are not whole units of {ep}")
    plan_: dict[int, list[int]] = {}
    for leader, block in place(ids, leaders).items():
        members = list(range(leader, leader + ep))
        plan_.update(_blocks(list(block), members, even_quotas(len(block), members)))
    return plan_


def unit_timings(timings: Mapping[int, float | None], ep: int) -> dict[int, float | None]:
    """A unit's time per microbatch, keyed by its first replica: its slowest member's (the
    members wait for each other at every expert exchange), None while any is unknown."""
    if ep == 1:
        return dict(timings)
    units: dict[int, list[float | None]] = {}
    for replica, seconds in timings.items():
        units.setdefault(replica // ep * ep, []).append(seconds)
    known = {u: [s for s in ts if s is not None] for u, ts in units.items()}
    return {u: max(ts) if len(ts) == ep else None for u, ts in known.items()}
