"""One training iteration as a transaction (DESIGN §4):

    1. plan     layer 3 maps the M global microbatch ids to the live replicas
    2. execute  this replica runs its pipeline schedule over its quota; grads accumulate locally
    3. reduce   out-of-place DP reduction of grads + microbatch count, tokens, id checksums, loss
    4. commit   exactly the planned ids were reduced, else stop loudly (a bug, not a failure)
    5. step     tied-embedding sync, divide by the global token count, clip, optimizer, LR schedule

Every piece is passed in, so this file shows the whole order and nothing else.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from recover_patches.recovery.reduce import ReducedGradients, Totals, check_commit
from recover_patches.schedule import ScheduleResult

Planner = Callable[[Sequence[int], Sequence[int]], Mapping[int, list[int]]]
Executor = Callable[[list[int]], ScheduleResult]
Reducer = Callable[[Totals], ReducedGradients]
Stepper = Callable[[ReducedGradients], dict]


@dataclass
class IterationOutcome:
    iteration: int
    ids: list[int]
    assignment: dict[int, list[int]]
    totals: Totals
    step: dict  # what the step reports: loss, grad_norm, lr, ...
    seconds: dict[str, float] = field(default_factory=dict)  # execute / reduce / step


@dataclass
class IterationTransaction:
    replica: int
    live_replicas: list[int]
    plan: Planner
    execute: Executor
    reduce: Reducer
    step: Stepper

    def run(self, iteration: int, ids: Sequence[int]) -> IterationOutcome:
        ids = list(ids)
        clock = time.perf_counter()
        seconds: dict[str, float] = {}

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[name] = now - clock
            clock = now

        assignment = {r: list(q) for r, q in self.plan(ids, self.live_replicas).items()}
        done = self.execute(assignment.get(self.replica, []))
        lap("execute")
        reduced = self.reduce(Totals.of_ids(done.ids, done.tokens, done.loss_sum))
        lap("reduce")
        check_commit(reduced.totals, ids)
        report = self.step(reduced)
        lap("step")
        return IterationOutcome(iteration, ids, assignment, reduced.totals, report, seconds)
