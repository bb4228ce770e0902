"""The seeded fault plan: which faults, on which rank, at which point of the job's work.

Each fault is a `--inject-fault` spec (`recover_patches/faults.py`) given to every process at
its start (RECOVER_INJECT_FAULT): it fires when its rank reaches its phase at its iteration or
the first one after (`iter=I+`: a slot that waited as a spare then takes it when it trains
again), so the moment is random over the run's work and the same seed gives the same faults.
Faults of a phase that happens only now and then (a recovery, a join) take the first occasion
(`iter=any`). A ledger every process shares (RECOVER_FAULT_LEDGER) makes each fire once in the
whole run, whichever process of its slot, launch after launch. One that never fires (its slot
never trained again, the job ended first) is counted as such: the harness reads what fired
from the logs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# the phases every training iteration passes through (p2p with PP > 1, tp_allreduce with TP > 1)
ITERATION_PHASES = ("forward", "backward", "dp_reduce", "reduced", "ack", "exchange",
                    "confirmed", "optimizer")
# what the menu can draw, and how often (relative weights)
KINDS = {"kill": 5, "hang": 3, "stall": 2, "exit": 1, "node": 3, "cut": 2, "coordinator": 1,
         "etcd": 1, "recovery": 3, "join": 2, "checkpoint": 2, "eval": 1}


@dataclass(frozen=True)
class JobShape:
    """What the plan needs to know of the job."""
    world_size: int
    per_node: int  # ranks per launcher; node 0's launcher holds the coordinator
    train_iters: int
    timeout: float  # --recover-timeout T
    pipeline: int = 1
    tensor: int = 1
    save_interval: int | None = None
    eval_interval: int | None = None

    def __post_init__(self):
        if self.world_size < 2 * self.per_node or self.train_iters < 3:
            raise ValueError(f"a chaos job needs two nodes and three iterations: {self}")


@dataclass(frozen=True)
class PlannedFault:
    name: str  # the menu's entry (`recovery`: a kill during a recovery, ...)
    kind: str  # the injector's kind
    rank: int
    iteration: int | None  # None: the first occasion (iter=any)
    phase: str
    seconds: float = 0.0

    def spec(self) -> str:
        fields = [f"rank={self.rank}", f"iter={'any' if self.iteration is None else f'{self.iteration}+'}",
                  f"phase={self.phase}"]
        if self.kind == "stall":
            fields.append(f"seconds={self.seconds:.2f}")
        return f"{self.kind}:{','.join(fields)}"

    def fired_by(self, rank: int, kind: str, iteration: int, phase: str) -> bool:
        """Whether an `injecting KIND at iter I phase P` line of `rank` is this fault's."""
        return (rank, kind, phase) == (self.rank, self.kind, self.phase) and \
            (self.iteration is None or iteration >= self.iteration)


def phases(shape: JobShape) -> tuple[str, ...]:
    return ITERATION_PHASES + (("p2p",) if shape.pipeline > 1 else ()) + \
        (("tp_allreduce",) if shape.tensor > 1 else ())


def draw(rng: random.Random, name: str, shape: JobShape, within: range) -> PlannedFault | None:
    """One fault of the menu's entry `name`, at an iteration drawn from `within`; None where
    the job has no such moment."""
    rank = rng.randrange(shape.world_size)
    iteration = rng.choice(within)
    phase = rng.choice(phases(shape))
    if name in ("kill", "hang", "exit"):
        return PlannedFault(name, name, rank, iteration, phase)
    if name == "stall":  # slow for a moment: below T the job waits, past T it is fenced
        return PlannedFault(name, "stall", rank, iteration, phase,
                            seconds=rng.uniform(0.5, 2.0) * shape.timeout)
    if name == "etcd":
        return PlannedFault(name, "etcd", rank, iteration, phase)
    if name in ("node", "cut"):  # not node 0: its launcher runs the coordinator
        return PlannedFault(name, name, rng.randrange(shape.per_node, shape.world_size),
                            iteration, phase)
    if name == "coordinator":
        return PlannedFault(name, "coordinator", rng.randrange(shape.per_node), iteration, phase)
    if name in ("recovery", "join"):  # the first occasion
        return PlannedFault(name, rng.choice(("kill", "hang")), rank, None, name)
    if name == "checkpoint" and shape.save_interval:
        saves = range(shape.save_interval, shape.train_iters + 1, shape.save_interval)
        return PlannedFault(name, rng.choice(("kill", "node")) if rank >= shape.per_node
                            else "kill", rank, rng.choice(saves), "checkpoint") if saves else None
    if name == "eval" and shape.eval_interval and shape.eval_interval <= shape.train_iters:
        evals = range(shape.eval_interval, shape.train_iters + 1, shape.eval_interval)
        return PlannedFault(name, "kill", rank, rng.choice(evals), "eval")
    return None


def menu(kinds: dict[str, int], netns: bool, etcd: bool) -> dict[str, int]:
    """The kinds a job can be given: a cut needs a network namespace per launcher (on loopback
    no node has a link of its own); an etcd leader's kill needs the etcd rendezvous, where the
    coordinator is elected, not node 0's launcher's child (no coordinator kill then)."""
    gone = {"cut"} if not netns else set()
    gone |= {"coordinator"} if etcd else {"etcd"}
    return {k: w for k, w in kinds.items() if k not in gone}


def stratum(index: int, count: int, shape: JobShape) -> range:
    """The index-th of `count` equal spans of iterations 2 .. train_iters: one fault is drawn in
    each, so they are random but spread over the run (each has time to be recovered from)."""
    span = shape.train_iters - 1
    first = 2 + index * span // count
    return range(first, max(first + 1, 2 + (index + 1) * span // count))


def plan(seed: int, count: int, shape: JobShape, kinds: dict[str, int] | None = None
         ) -> list[PlannedFault]:
    """`count` faults drawn from the menu by weight (entries the job has no moment for are
    drawn again), one per stratum of the run, ordered by iteration; the same seed and shape
    give the same plan."""
    rng = random.Random(seed)
    menu = {k: w for k, w in (kinds or KINDS).items() if w > 0}
    faults: list[PlannedFault] = []
    while len(faults) < count:
        name = rng.choices(list(menu), weights=list(menu.values()))[0]
        fault = draw(rng, name, shape, stratum(len(faults), count, shape))
        if fault is not None:
            faults.append(fault)
    return sorted(faults, key=lambda f: (f.iteration or 0, f.rank))
