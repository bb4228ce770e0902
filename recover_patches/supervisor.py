"""The launcher's watch over its node's processes: wait for them, forward stop signals, report
exits to the coordinator, fence the ones it declared dead, start replacements, and sum up the
launch's exit status (rules in `recover_patches/launch.py`'s docstring)."""
from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from recover_patches.collectives import stacks
from recover_patches.collectives.node_beats import NodeBeatRelay
from recover_patches.health import FailureWindow

logger = logging.getLogger(__name__)


@dataclass
class Rank:
    rank: int  # -1: a standby process not given a slot (yet)
    pid: int
    status: int | None = None  # raw waitpid status once exited
    incarnation: int = 0  # > 0: a replacement process for this rank
    replaced: bool = False
    local: int = 0  # LOCAL_RANK: its GPU on this node
    standby: str | None = None  # RECOVER_STANDBY of a standby process

    @property
    def name(self) -> str:
        return f"rank {self.rank}" if self.rank >= 0 else f"standby {self.standby}"

    @property
    def exit_code(self) -> int | None:
        return None if self.status is None else os.waitstatus_to_exitcode(self.status)


def describe(code: int) -> str:
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


class Supervisor:
    """Waits for the ranks, forwards termination signals, feeds the coordinator link."""

    NOT_REPLACED = (0, 2, 3)  # a clean leave, a user error, the job's own restart status

    def __init__(self, ranks: list[Rank], term_grace: float, link=None,
                 respawn: Callable[[Rank], Rank] | None = None, max_replacements: int = 0,
                 coordinator=None, beats: NodeBeatRelay | None = None,
                 stop_grace: float = 5.0, admit: Callable[[Rank], str | None] = lambda r: None,
                 failures: FailureWindow | None = None):
        self.ranks = {r.pid: r for r in ranks}
        # after the coordinator stopped the job: the ranks' own time to end with their line (one
        # in a collective with a dead peer fails within T; spares look every half second)
        self.stop_grace = stop_grace
        self.admit = admit  # the node's health check before a replacement: None, or why not
        self.failures = failures or FailureWindow(window=600.0)  # this node's rank failures
        self.beats = beats  # the ranks' heartbeats, forwarded over the link once per interval
        self.coordinator = coordinator  # a CoordinatorHandle: restarted here if its process dies
        self.term_grace = term_grace
        self.link = link
        self.respawn = respawn
        self.replacements_left = max_replacements
        self.kill_deadline: float | None = None
        self.stop_signal: int | None = None
        self.fenced: set[tuple[int, int]] = set()  # (rank, incarnation)
        self.cut_off: str | None = None  # why this node fenced itself, once it did

    def live(self) -> list[Rank]:
        return [r for r in self.ranks.values() if r.status is None]

    def on_signal(self, signum: int, _frame) -> None:
        if self.stop_signal is not None:  # second Ctrl-C: no more patience
            self.kill_deadline = 0.0
            return
        self.stop_signal = signum
        self.kill_deadline = time.monotonic() + self.term_grace
        logger.info(f"got {signal.Signals(signum).name}: sending SIGTERM to {len(self.live())} rank(s)")
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        for r in self.live():
            try:
                os.kill(r.pid, sig)
            except ProcessLookupError:
                pass

    def run(self) -> None:
        """Block until every rank has exited; a signal or a child exit wakes the loop at once."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        pidfds: dict[int, int] = {}  # pid -> fd; an exited child's fd stays readable: unregister it
        try:
            for r in self.live():
                pidfds[r.pid] = os.pidfd_open(r.pid)
                poller.register(pidfds[r.pid], select.POLLIN)
        except (OSError, AttributeError):  # no pidfd (kernel < 5.3): poll waitpid instead
            pass
        polling = len(pidfds) < len(self.live())
        try:
            while True:
                self._reap()
                for r in self.live():  # replacements started since
                    if not polling and r.pid not in pidfds:
                        pidfds[r.pid] = os.pidfd_open(r.pid)
                        poller.register(pidfds[r.pid], select.POLLIN)
                for r in self.ranks.values():
                    if r.status is not None and r.pid in pidfds:
                        fd = pidfds.pop(r.pid)
                        poller.unregister(fd)
                        os.close(fd)
                if not self.live():
                    return
                if self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
                    logger.info(f"grace period over: SIGKILL to {len(self.live())} rank(s)")
                    self._signal_all(signal.SIGKILL)
                    self.kill_deadline = float("inf")
                if self.coordinator is not None and self.stop_signal is None:
                    self.coordinator.restart_if_dead()
                if self.link is not None:
                    self._learn_slots()
                    self._fence(self.link.dead_incarnations())
                    self._end_if_stopped()
                    self._forward_beats()
                timeout = 0.01 if polling else (0.2 if self.link is not None else 5.0)
                if self.beats is not None and self.link is not None:
                    timeout = min(timeout, self.beats.due_in())
                if self.kill_deadline is not None:
                    timeout = max(0.0, min(timeout, self.kill_deadline - time.monotonic()))
                poller.poll(timeout * 1000)
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for fd in (*pidfds.values(), wake_r, wake_w):
                os.close(fd)

    def _forward_beats(self) -> None:
        if self.beats is not None and self.link is not None:
            beats = self.beats.collect(r.pid for r in self.live())
            if beats is not None:
                self.link.forward_beats(self.beats.node, beats)

    def _reap(self) -> None:
        for r in self.live():
            pid, status = os.waitpid(r.pid, os.WNOHANG)
            if pid == 0:
                continue
            r.status = status
            if r.rank < 0 and self.link is not None:
                self._learn_slots()  # it may have been given a slot just before it ended
            replacing = self._should_replace(r)
            if self.link is not None:
                if r.rank >= 0:  # the coordinator gives its slot away only if none is coming
                    # (a standby node's new process is a new standby, not this slot's)
                    self.link.report_exit(r.rank, r.exit_code, r.incarnation,
                                          replacing and r.standby is None)
                else:
                    self.link.report_standby_exit(str(r.standby))
            if replacing:
                self.replacements_left -= 1
                assert self.respawn is not None
                new = self.respawn(r)
                r.replaced = True
                self.ranks[new.pid] = new
                logger.info(f"{r.name} ({describe(r.exit_code or 0)}): started replacement pid "
                            f"{new.pid} ({new.name}, incarnation {new.incarnation}, "
                            f"{self.replacements_left} left)")

    def _learn_slots(self) -> None:
        """Which slot each standby process was given: fencing and exit reports go by slot."""
        waiting = {r.standby: r for r in self.ranks.values() if r.rank < 0 and r.standby}
        if not waiting or self.link is None:
            return
        for standby, (rank, incarnation) in self.link.assignments(list(waiting)).items():
            waiting[standby].rank, waiting[standby].incarnation = rank, incarnation
            logger.info(f"standby {standby} (pid {waiting[standby].pid}) took rank {rank}")

    def fence_node(self, why: str) -> None:
        """This node is cut off from the job (`collectives/self_fence.py`, on its thread): its
        ranks are SIGKILLed and none is replaced; the loop then ends as they are reaped."""
        self.cut_off = why
        logger.error(f"fencing this node's ranks: {why}")
        for r in list(self.ranks.values()):  # (one C-level copy: safe beside the main thread)
            if r.status is None:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _should_replace(self, r: Rank) -> bool:
        if r.exit_code in self.NOT_REPLACED:
            return False
        self.failures.note()  # a crash, a kill, a fence: this node's rank failed
        if not (self.respawn is not None and self.replacements_left > 0 and self.cut_off is None
                and self.stop_signal is None and self.link is not None
                and self.link.completion() is None and self.link.stop_reason() is None):
            return False
        return self._admitted(r)

    def _admitted(self, r: Rank) -> bool:
        """Admission: not after the node's second failure within the window, and only once
        the node's health check passed; otherwise the slot may go to a standby node."""
        why: str | None = self.admit(r) if not self.failures.exhausted() else (
            f"{self.failures.limit} rank failures on this node within "
            f"{self.failures.window:g}s: it starts no replacement again")
        if why is not None:
            logger.warning(f"{r.name}: no replacement on this node: {why}")
        return why is None

    def _end_if_stopped(self) -> None:
        """The coordinator stopped the job (no unit holds the training state): nothing of it can
        go on. The ranks end by themselves, each with its line; what still runs after
        `stop_grace` is killed, so no process waits on a dead job."""
        assert self.link is not None
        if self.link.stopped is None or self.kill_deadline is not None or not self.live():
            return
        logger.warning(f"the job stopped ({self.link.stopped}): {len(self.live())} process(es) "
                       f"of this node get {self.stop_grace:g}s to end")
        self.kill_deadline = time.monotonic() + self.stop_grace

    def _fence(self, dead: dict[int, int]) -> None:
        for r in self.live():
            if dead.get(r.rank, -1) >= r.incarnation and (r.rank, r.incarnation) not in self.fenced:
                self.fenced.add((r.rank, r.incarnation))
                logger.info(f"{r.name} declared dead by the coordinator: SIGKILL")
                stacks.of_rank(r.pid, f"{r.name} before its fence")
                os.kill(r.pid, signal.SIGKILL)


def summarize(ranks: list[Rank], completion: tuple[int, frozenset[int]] | None,
              stopped: str | None = None) -> int:
    """The launch's status from its processes' (see `launch.py`); `stopped`: why the
    coordinator stopped the job, which makes it the restart status 3 -- unless a rank of this node
    crashed (status 1: a traceback says where; a restart would only crash again)."""
    failed = [r for r in ranks if r.exit_code != 0 and not r.replaced]
    for r in ranks:
        if r.replaced:
            logger.info(f"{r.name} (pid {r.pid}) {describe(r.exit_code or 0)}: replaced")
    ranks = [r for r in ranks if not r.replaced]
    for r in failed:
        logger.info(f"{r.name} (pid {r.pid}) failed: {describe(r.exit_code or 0)}")
    if stopped is not None and completion is None and all(r.exit_code != 1 for r in failed):
        logger.info(f"the job stopped ({stopped}): status 3, for a restart from the last "
                    "checkpoint")
        return 3
    if not failed:
        logger.info(f"all {len(ranks)} "
                    f"{'standby process(es)' if any(r.standby for r in ranks) else 'rank(s)'} exited 0")
        return 0
    if completion is not None:
        epoch, dead = completion
        unexpected = [r.rank for r in failed if r.rank not in dead]
        if not unexpected:
            logger.info(f"{len(failed)} of {len(ranks)} rank(s) failed, but the job declared "
                        f"completion at epoch {epoch} with those ranks already dead: success")
            return 0
        logger.info(f"job declared completion at epoch {epoch}, but rank(s) {unexpected} failed "
                    "outside it")
    codes = {r.exit_code for r in failed}
    if codes == {2}:
        logger.info(f"{len(failed)} of {len(ranks)} rank(s) stopped on a user error (status 2)")
        return 2
    if codes <= {2, 3}:
        logger.info(f"{len(failed)} of {len(ranks)} rank(s) stopped the job for a restart (status 3)")
        return 3
    logger.info(f"{len(failed)} of {len(ranks)} rank(s) failed")
    return 1
