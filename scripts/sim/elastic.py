"""In-job strategies: ReCoVer (`recover`) and replica dropping (`drop`).

Both keep running on the surviving replicas after a failure; they differ in what an iteration is:

* recover: every iteration keeps the full global batch. With L of D replicas it takes D/L times longer,
  so throughput is L/D of nominal. A failure loses only the broken replica's share of the iteration in
  progress (1/L of the work done in it so far), which survivors recompute, plus `recovery_seconds`.
* drop: iterations keep their duration and the global batch shrinks to L/D; same token throughput, but
  a different training trajectory (the batch, hence the gradient noise and the LR-per-token, changed).
  A failure drops the broken replica's finished part of the iteration in progress (its 1/D share).
  Both pause `recovery_seconds` per failure (assumption: a torchft-style quorum and group rebuild cost
  about what ReCoVer's detection, rebuild and re-plan cost).

Work is tracked as a fluid between events (an iteration is tiny against hours of simulated time).
Replica re-forming (when spares or repair are configured): a broken replica's healthy GPUs return to the
pool, its failed GPU goes to repair; whenever the pool holds tp*pp GPUs and fewer than D replicas are
live or joining, a replica is formed and joins `rejoin_seconds` later (the replacement's start-up
and wait for the grow epoch, overlapping training), then every replica pauses `join_pause_seconds`
(the trainer's join: agreement, group rebuild and state transfer at an iteration boundary; 0 models
a transfer that overlaps training).
Re-entrant recovery: a failure during recovery starts the recovery pause again.
"""

from __future__ import annotations

import heapq
import math

from scripts.sim.config import SimConfig
from scripts.sim.failures import FailureTrace
from scripts.sim.pool import GpuPool
from scripts.sim.result import SimResult, TimelineRecorder


def simulate_elastic(config: SimConfig, trace: FailureTrace, shrink_batch: bool) -> SimResult:
    full, group = config.dp, config.replica_gpus
    iteration_hours, per_iteration = config.iteration_hours, config.tokens_per_iteration
    recovery_hours, rejoin_hours = config.recovery_seconds / 3600.0, config.rejoin_seconds / 3600.0
    pool = GpuPool(config.spare_gpus, config.repair_hours)
    live, joining = full, list[float]()  # joining: heap of times re-formed replicas become live
    tokens = iterations = 0.0
    now, paused_until, next_failure = 0.0, 0.0, 0
    failures, min_live = 0, full
    timeline = TimelineRecorder()

    while True:
        failure_at = trace.times_hours[next_failure] if next_failure < len(trace) else math.inf
        join_at = joining[0] if joining else math.inf
        upcoming = min(failure_at, join_at, pool.next_return(), config.run_hours)

        resume = max(now, paused_until)
        if now < resume < upcoming:
            timeline.add(resume, tokens)   # end of a recovery pause: a kink in the timeline
        busy = max(0.0, upcoming - resume)
        if live > 0:
            tokens += busy * config.nominal_tokens_per_hour * live / full
            iterations += busy / iteration_hours * (1.0 if shrink_batch else live / full)
        now = upcoming
        timeline.add(now, tokens)
        if now >= config.run_hours:
            break

        if now == failure_at:
            next_failure += 1
            if not trace.hits(next_failure - 1, live * group):
                continue
            in_progress = iterations - math.floor(iterations)
            if shrink_batch:
                tokens -= in_progress * per_iteration / full
            else:
                iterations -= in_progress / live
                tokens = iterations * per_iteration
            live -= 1
            failures += 1
            min_live = min(min_live, live)
            paused_until = now + recovery_hours
            pool.send_to_repair(now)
            if config.elastic:
                pool.give(group - 1)
        elif now == join_at:
            heapq.heappop(joining)
            live += 1
            paused_until = max(paused_until, now + config.join_pause_seconds / 3600.0)
        else:
            pool.collect(now)

        if config.elastic:
            while live + len(joining) < full and pool.healthy >= group:
                pool.take(group)
                heapq.heappush(joining, now + rejoin_hours)
        timeline.add(now, tokens)

    hours, committed = timeline.arrays()
    return SimResult(
        strategy="drop" if shrink_batch else "recover", config=config, tokens=tokens,
        iterations=iterations, failures=failures, final_replicas=live,
        min_batch_fraction=min_live / full if shrink_batch else 1.0,
        timeline_hours=hours, timeline_tokens=committed)
