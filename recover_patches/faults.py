"""Deterministic fault injection (design.md §15). Off unless asked for.

Spec (flag ``--inject-fault``, repeatable; or env RECOVER_INJECT_FAULT, ';'-separated):
    kind:rank=R,iter=I,phase=P[,microbatch=K]
    slow:rank=R,seconds=S[,iter=I][,phase=P][,microbatch=K]
    stall:rank=R,iter=I,phase=P,seconds=S[,microbatch=K]
    exit:rank=R,iter=I,phase=P[,code=C]
  and any of them may end with `,incarnation=N`: only that process of the slot (0: the one the
  job started with, N: its N-th replacement) takes the fault. `iter=I+` (one-shot kinds): the
  first matching call at iteration I or later.

RECOVER_FAULT_LEDGER=DIR (a directory every process of the job sees): a one-shot fault fires once
in the job, in whichever process of its slot reaches it first -- a replacement, or the job
restarted from a checkpoint with the same ledger (`scripts/chaos.py`), does not take it again.

Kinds:
  kill   SIGKILL this process (a crash: no cleanup, no exit handlers);
  hang   SIGSTOP this process (a hang: every thread stops, heartbeats too; if someone sends
         SIGCONT, training just continues);
  node   SIGKILL this process's whole process group: its launcher and everything the launcher
         started (a lost node). Start each node's launcher in its own process group (a shell job,
         `setsid`, srun); the group of a launcher that started the coordinator holds it too;
  cut    this process's node is cut off the network by whoever started it in a network
         namespace of its own, on reading the fault's line (`scripts/chaos.py`); the process
         itself only pauses HARNESS_PAUSE seconds at the phase, so that the cut lands there;
  etcd   the same, for the leader of the etcd members an elected coordinator's rendezvous
         uses: whoever runs them kills it on reading the line;
  coordinator  SIGKILL the membership coordinator the launcher started (RECOVER_COORDINATOR_PID):
         the node-0 launcher starts a new one and the ranks reconnect;
  exit   os._exit(C) (default C=1) after flushing stdout/stderr: a process that quits abruptly
         with a status, e.g. a failing node-health check;
  watchdog  the collectives' watchdog thread gets stuck (NCCL and the emulated NCCL): its
         backstop must fence the rank;
  slow   sleep S seconds at every matching call from iteration I on (default I=0, phase forward),
         i.e. a persistently slow replica for the workload policy;
  stall  sleep S seconds once, at the first matching call: a rank slow for a moment (past T,
         its peers declare it dead and its launcher fences it);
  inf    an overflowing gradient: the trainer's action writes an inf into this rank's accumulated
         gradients (fp16's loss scaler must then skip the step);
  corrupt  silent data corruption: the trainer's action changes one weight of this rank (the
         weight check across replicas must notice).
inf and corrupt run the action the trainer registered in `FaultInjector.actions` for the kind.
kill, node, cut, etcd, hang, stall and exit fire once: at the first `at()` call with the same phase and iteration (and
microbatch, if the spec gives one). Faults for other ranks are ignored. iter=any matches the
first call of the phase whatever the iteration. Phase `join` with iter=I is a donor rank about to send its state to a joining replica after iteration I - 1,
or a joining rank about to receive it;
phase `eval` with iter=I is a forward pass of the evaluation after iteration I; between the
reduction and the step come `reduced` (the DP reduction returned), `ack` (before the ack over the
DP group), `exchange` (acked, before the exchange over the replica) and `confirmed` (committed,
before the step; `optimizer` follows the gradient norm); phase
`param_gather` is the distributed optimizer's weight all-gather, after this rank stepped its slice. A
replacement process (launch --max-replacements) gets its rank's specs again; a one-shot fault at
an iteration it joins after never fires.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KINDS = ("kill", "node", "cut", "etcd", "hang", "exit", "slow", "stall", "inf", "corrupt",
         "coordinator", "watchdog")
HARNESS_KINDS = ("cut", "etcd")  # made by whoever reads the fault's line
HARNESS_PAUSE = 1.0  # seconds such a rank waits at its phase for the fault to be made
PHASES = ("forward", "backward", "p2p", "tp_allreduce", "cp_exchange", "ep_dispatch",
          "ep_alltoall", "dp_reduce", "reduced", "ack", "exchange", "confirmed", "optimizer",
          "param_gather", "checkpoint", "recovery", "join", "eval")
ENV_VAR = "RECOVER_INJECT_FAULT"
LEDGER_ENV_VAR = "RECOVER_FAULT_LEDGER"
ANY = -1  # iter=any: the first matching call, whatever the iteration
FORMAT = ("expected kind:rank=R,iter=I,phase=P[,microbatch=K][,incarnation=N] (slow: seconds=S "
          "instead of iter; stall: seconds=S too) "
          f"with kind in {'|'.join(KINDS)} and phase in {'|'.join(PHASES)}")


class FaultSpecError(ValueError):
    """A malformed --inject-fault spec; the message names the flag and the spec."""


@dataclass
class Fault:
    kind: str
    rank: int
    iteration: int
    phase: str
    microbatch: int | None = None
    seconds: float = 0.0
    code: int = 1
    incarnation: int | None = None  # only this process of the slot; None: every one
    or_later: bool = False  # iter=I+: at iteration I or the first one after it
    fired: bool = False

    def matches(self, phase: str, iteration: int, microbatch: int | None) -> bool:
        if self.fired or phase != self.phase:
            return False
        if self.microbatch is not None and microbatch != self.microbatch:
            return False
        if self.iteration == ANY:
            return True
        if self.kind == "slow" or self.or_later:
            return iteration >= self.iteration
        return iteration == self.iteration

    def key(self) -> str:
        """The fault's name in the ledger: the same in every process given the same spec."""
        where = "any" if self.iteration == ANY else f"{self.iteration}{'+' if self.or_later else ''}"
        return f"{self.kind}-r{self.rank}-i{where}-{self.phase}-m{self.microbatch}-n{self.incarnation}"


def parse_spec(spec: str) -> Fault:
    def bad(reason: str) -> FaultSpecError:
        return FaultSpecError(f"--inject-fault {spec!r}: {reason}; {FORMAT}")

    kind, sep, rest = spec.strip().partition(":")
    if not sep or kind not in KINDS:
        raise bad(f"unknown kind {kind!r}" if sep else "missing 'kind:'")
    fields: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() in fields:
            raise bad(f"bad or repeated field {item!r}")
        fields[key.strip()] = value.strip()
    allowed = {"rank", "iter", "phase", "microbatch", "incarnation"} | {
        "slow": {"seconds"}, "stall": {"seconds"}, "exit": {"code"}}.get(kind, set())
    unknown = set(fields) - allowed
    if unknown:
        raise bad(f"unknown field(s) {sorted(unknown)} for {kind}")
    required = {"rank", "seconds"} if kind == "slow" else {"rank", "iter", "phase"} | (
        {"seconds"} if kind == "stall" else set())
    if required - set(fields):
        raise bad(f"missing {sorted(required - set(fields))}")
    try:
        text = fields.get("iter", "0")
        or_later = text.endswith("+")
        iteration = ANY if text == "any" else int(text.removesuffix("+"))
        fault = Fault(kind=kind, rank=int(fields["rank"]), iteration=iteration, or_later=or_later,
                      phase=fields.get("phase", "forward"),
                      microbatch=int(fields["microbatch"]) if "microbatch" in fields else None,
                      seconds=float(fields.get("seconds", 0.0)), code=int(fields.get("code", 1)),
                      incarnation=int(fields["incarnation"]) if "incarnation" in fields else None)
    except ValueError:
        raise bad("rank, iter (or iter=any, or iter=I+), microbatch, code and incarnation must "
                  "be integers, seconds a number") from None
    if fault.phase not in PHASES:
        raise bad(f"unknown phase {fault.phase!r}")
    if fault.rank < 0 or fault.iteration < ANY or (fault.microbatch or 0) < 0 or fault.seconds < 0:
        raise bad("values must not be negative")
    return fault


class FaultInjector:
    """This rank's faults. Call `at(phase, iteration, microbatch)` at each injection point."""

    def __init__(self, faults: list[Fault], rank: int, *, kill: Callable[[int, int], None] = os.kill,
                 exit: Callable[[int], None] = os._exit, sleep: Callable[[float], None] = time.sleep,
                 incarnation: int = 0, ledger: str | None = None):
        self.rank = rank
        self.ledger = ledger  # RECOVER_FAULT_LEDGER: one-shot faults fire once in the job
        self.faults = [f for f in faults if f.rank == rank
                       and f.incarnation in (None, incarnation)]
        self._kill, self._exit, self._sleep = kill, exit, sleep
        self.actions: dict[str, Callable[[], None]] = {}  # inf / corrupt: set by the trainer

    def set_actions(self, **actions: Callable[[], None]) -> None:
        """What `inf` and `corrupt` faults do (the trainer knows its buffers and weights)."""
        self.actions.update(actions)

    @classmethod
    def from_specs(cls, specs: list[str] | None, rank: int, **actions) -> "FaultInjector":
        """Faults from the flag values plus env RECOVER_INJECT_FAULT. Raises FaultSpecError."""
        all_specs = list(specs or []) + [s for s in os.environ.get(ENV_VAR, "").split(";") if s.strip()]
        incarnation = int(os.environ.get("RECOVER_INCARNATION", "0"))  # (a standby's: its slot's)
        return cls([parse_spec(s) for s in all_specs], rank, incarnation=incarnation,
                   ledger=os.environ.get(LEDGER_ENV_VAR) or None, **actions)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def at(self, phase: str, iteration: int, microbatch: int | None = None) -> None:
        if not self.faults:
            return
        if phase not in PHASES:
            raise ValueError(f"unknown fault-injection phase {phase!r}; known: {PHASES}")
        for fault in self.faults:
            if fault.matches(phase, iteration, microbatch):
                self._fire(fault, iteration, microbatch)

    def _fire(self, fault: Fault, iteration: int, microbatch: int | None) -> None:
        if fault.kind == "slow":
            self._sleep(fault.seconds)
            return
        fault.fired = True
        if not self._claim(fault):
            return  # another process of the slot (or an earlier launch) took it
        where = f"iter {iteration} phase {fault.phase}" + (
            f" microbatch {microbatch}" if microbatch is not None else "")
        logger.info(f"injecting {fault.kind} at {where}")  # flushed: the process may end now
        if fault.kind == "stall":
            self._sleep(fault.seconds)
        elif fault.kind in ("inf", "corrupt"):
            if fault.kind not in self.actions:
                raise RuntimeError(f"a {fault.kind} fault fired before the trainer set its action")
            self.actions[fault.kind]()
        elif fault.kind == "kill":
            self._kill(os.getpid(), signal.SIGKILL)
        elif fault.kind in HARNESS_KINDS:  # the harness reads the line above and makes it
            self._sleep(HARNESS_PAUSE)
        elif fault.kind == "node":
            self._kill(-os.getpgrp(), signal.SIGKILL)
        elif fault.kind == "hang":
            self._kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "watchdog":
            from recover_patches.collectives.watchdog import WATCHDOG
            WATCHDOG.stall()
        elif fault.kind == "coordinator":
            pid = os.environ.get("RECOVER_COORDINATOR_PID")
            if not pid:
                raise RuntimeError("a coordinator fault needs the coordinator the launcher starts "
                                   "(RECOVER_COORDINATOR_PID is not set)")
            self._kill(int(pid), signal.SIGKILL)
        else:
            self._exit(fault.code)

    def _claim(self, fault: Fault) -> bool:
        """Whether this process takes the fault: always without a ledger; with one, only the
        first to create its entry (an atomic create, shared by every process of the job)."""
        if self.ledger is None:
            return True
        try:
            os.close(os.open(os.path.join(self.ledger, fault.key()),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
