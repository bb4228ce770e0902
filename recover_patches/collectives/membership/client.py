"""A rank's view of the job's membership, kept current by two small background threads.

* the watcher blocks on this rank's notification queue (``notify/<rank>``), where the coordinator
  pushes every new epoch, so a new epoch is seen at once; it then calls the listeners (the process
  groups), which abort their pending operations;
* the heartbeat thread writes a beat counter and where the rank is (its progress marks, `mark()`),
  so the coordinator can tell a rank that is alive but stuck from one that waits (`liveness.py`):
  into a file its launcher forwards with the node's other ranks (`node_beats.py`: no store
  operation), or, without a ReCoVer launcher, to ``hb/<rank>`` every `heartbeat_interval`.
Each has its own store connection: a TCPStore client serializes its requests, so a blocked pop
would otherwise stall everyone. (A blocking pop: every timed-out store wait prints C++ warnings.)

If the coordinator goes away (its process died and the node-0 launcher started a new one on the
same port, or etcd elected one elsewhere: the node's address file moves), a watcher
reconnects: it registers again with what this rank knows (its latest epoch record, whether it
waits as a spare), replaces `store`, bumps `generation` and calls the reconnect listeners (the
agreement re-publishes its last decisions there). The main thread's store operations fail
meanwhile, within T even on a cut link (`counted_store.py` bounds them); callers that must
survive the gap (the commit vote) call `reconnect_after()`, wait for `wait_reconnected()` and
retry. A failure of the main connection alone (a coordinator that restarted and, serving every
rank's registration at once, did not answer within T, while the watcher's connection holds) is
a lost connection too: the watcher would never notice it, so `reconnect_after()` registers again
itself.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from recover_patches.collectives import stacks
from recover_patches.collectives import protocol as P
from recover_patches.collectives.bounded_call import BoundedCaller
from recover_patches.collectives.counted_store import CountedStore, OpCounter
from recover_patches.collectives.node_beats import LOCAL_BEATS_PER_INTERVAL, NodeBeats, write_beat
from recover_patches.collectives.progress_marks import ProgressMarks
from recover_patches.collectives.membership.job_reports import JobReports
from recover_patches.collectives.errors import (CoordinatorConfigError, CoordinatorUnreachable,
                                                JobTokenRefused, MembershipTimeout)
from recover_patches.collectives.timeouts import RECONNECT_WITHIN, REPORT_WAIT, Timeouts

logger = logging.getLogger("recover_patches.collectives.membership")  # [recover.membership]

EpochListener = Callable[[int, frozenset[int]], None]
ReconnectListener = Callable[[CountedStore], None]


class MembershipClient(JobReports):
    """One per rank. `store` is the coordinator's store under this job's prefix; `timeout` is the
    rank's --recover-timeout, from which every wait derives (the coordinator checks that all ranks
    agree on it)."""

    def __init__(self, host: str, port: int, token: str, rank: int, world_size: int, *,
                 timeout: float = 10.0, connect_timeout: float = 30.0,
                 source: str = "RECOVER_COORDINATOR", incarnation: int = 0,
                 standby: str | None = None, node_beats: NodeBeats | None = None,
                 address_file: Path | None = None, startup: float = 0.0,
                 unit: Sequence[int] = ()):
        self.rank = rank
        self.world_size = world_size
        self.incarnation = incarnation  # > 0: a replacement process for this rank's slot
        self.timeouts = Timeouts(timeout)
        # start-up (every rank building every group at once) may keep the coordinator's store
        # from answering within T on a healthy job: its answers get `startup` until settle()
        self._answer_within = max(timeout, startup)
        self.heartbeat_interval = self.timeouts.heartbeat_interval
        self.heartbeat_timeout = self.timeouts.stall
        self._progress = ProgressMarks()  # what the heartbeat says: see mark()
        self._unit = tuple(unit)  # the slots whose death breaks this rank's replica
        self._address = (host, port, token, source, standby)
        self._address_file = address_file  # the elected coordinator's (etcd), re-read to connect
        self._node_beats = node_beats  # beat into the launcher's directory, not the store
        self._beat_every = self.heartbeat_interval if node_beats is None else \
            self.heartbeat_interval / LOCAL_BEATS_PER_INTERVAL
        self._ops = OpCounter()  # every store operation of this rank: see store_ops
        self._bounded = BoundedCaller(REPORT_WAIT, f"recover-report-{rank}")
        self._open(connect_timeout)
        self.generation = 0  # reconnections to a restarted coordinator so far
        self._spare_slots: list[int] | None = None  # told the coordinator it waits as a spare
        self._changed = threading.Condition()
        self._listeners: list[EpochListener] = []
        self._on_reconnect: list[ReconnectListener] = []
        self._epoch, self._dead, self._record = P.read_latest(self.store)
        self._stop = threading.Event()
        self._beats = 0
        self._beat_once()
        self._reconnecting = threading.Lock()  # one reconnection at a time, from either thread
        self._moved_seen = -1  # the generation whose coordinator was seen to move
        self._watcher = self._thread(self._watch, "membership", 0)
        self._beater = self._thread(self._beat, "heartbeat")

    def _thread(self, target, what: str, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=f"recover-{what}", daemon=True)
        thread.start()
        return thread

    def _open(self, connect_timeout: float, rejoin: dict | None = None,
              attempt: float | None = None) -> None:
        """Register with the coordinator (again, with `rejoin`: what this rank knows) and open
        the three connections: the main thread's, the watcher's and the heartbeat's."""
        host, port, token, source, standby = self._address
        host, port = P.current_address(self._address_file, host, port)
        raw = P.connect(host, port, attempt or connect_timeout, source, attempt is not None)
        P.handshake(raw, token, "rank", self.rank, connect_timeout, self.incarnation, standby,
                    self.timeouts.operation, rejoin,
                    node=None if self._node_beats is None else self._node_beats.node,
                    startup=self._answer_within, unit=self._unit)
        store = CountedStore(dist.PrefixStore(P.job_prefix(token), raw), self._ops,  # bounded:
                             BoundedCaller(self._answer_within, f"recover-store-{self.rank}"))
        store.answer_within(self._answer_within, raw)  # a cut link's operations end
        self._store_client = raw
        config = json.loads(store.get(P.CONFIG))
        if config["world_size"] != self.world_size:
            raise CoordinatorConfigError(f"WORLD_SIZE={self.world_size} but the coordinator serves "
                                         f"a job of {config['world_size']} ranks")
        self._watch_store = self._connection(host, port, token, connect_timeout, source,
                                             blocking=timedelta(days=30))  # pops until news/close
        self._connected_to = (host, port)
        self._beat_store = None if self._node_beats is not None else \
            self._connection(host, port, token, connect_timeout, source)
        self.store = store

    def _connection(self, host, port, token, timeout, source, blocking=None) -> CountedStore:
        raw = P.connect(host, port, timeout, source)
        if blocking is not None:
            raw.set_timeout(blocking)
        return CountedStore(dist.PrefixStore(P.job_prefix(token), raw), self._ops)

    @property
    def backend_store(self) -> dist.Store:
        """The store a group's backend meets on (gloo's and NCCL's C++ need a real one)."""
        return self.store.native

    @property
    def store_ops(self) -> int:
        """This rank's operations on the coordinator's store so far, from every thread."""
        return self._ops.count

    @classmethod
    def from_env(cls, **kwargs) -> "MembershipClient":
        """RECOVER_COORDINATOR=host:port, RECOVER_JOB_TOKEN, RANK, WORLD_SIZE, and
        RECOVER_INCARNATION for a replacement process (all set by the launcher; RANK and
        RECOVER_INCARNATION by the coordinator for a process started as standby RECOVER_STANDBY)."""
        env = os.environ
        missing = [k for k in ("RECOVER_COORDINATOR", "RECOVER_JOB_TOKEN", "RANK", "WORLD_SIZE")
                   if not env.get(k)]
        if missing:
            raise CoordinatorConfigError(
                f"{', '.join(missing)} not set: start the job with `python -m recover_patches.launch` "
                "(which starts the coordinator) or export them")
        host, port = P.parse_address(env["RECOVER_COORDINATOR"], "RECOVER_COORDINATOR")
        return cls(host, port, env["RECOVER_JOB_TOKEN"], int(env["RANK"]), int(env["WORLD_SIZE"]),
                   incarnation=int(env.get("RECOVER_INCARNATION", "0")),
                   standby=env.get("RECOVER_STANDBY") or None,
                   node_beats=NodeBeats.from_env(env), **kwargs,
                   address_file=Path(env["RECOVER_COORDINATOR_FILE"])
                   if env.get("RECOVER_COORDINATOR_FILE") else None)

    def settle(self) -> None:
        """Start-up is over (an iteration committed): the store answers within T from now on,
        and the coordinator takes a silence of T + GRACE for a death again."""
        self._progress.settle()
        if self._answer_within != self.timeouts.operation:
            self._answer_within = self.timeouts.operation
            self.store.answer_within(self._answer_within, self._store_client)

    # --- the current view -------------------------------------------------------------------
    def epoch(self) -> int:
        return self._epoch

    def dead_ranks(self) -> frozenset[int]:
        return self._dead

    def dead_in(self, epoch: int) -> frozenset[int]:
        """The dead set the coordinator declared in `epoch` (read from its record)."""
        return frozenset(json.loads(self.store.get(P.epoch_key(epoch)))["dead"])

    def view(self) -> tuple[int, frozenset[int]]:
        """Epoch and its dead set, read together."""
        with self._changed:
            return self._epoch, self._dead

    def joining(self) -> frozenset[int]:
        """Ranks the current epoch made members again (a grow epoch), else empty."""
        with self._changed:
            return frozenset(self._record.get("joining", ()))

    def add_listener(self, listener: EpochListener) -> None:
        with self._changed:
            self._listeners.append(listener)

    def add_reconnect_listener(self, listener: ReconnectListener) -> None:
        """`listener(new_store)` runs on the watcher thread at each reconnection, before callers
        waiting for it go on; if it raises a store's RuntimeError, the rank registers again."""
        self._on_reconnect.append(listener)

    def reconnect_after(self, generation: int, error: Exception) -> None:
        """The main thread's store operation on connection `generation` failed: register again
        (on a new watcher thread, as a moved coordinator is followed) unless a reconnection
        since did. Callers then `wait_reconnected(generation)`."""
        if self.generation == generation and not self._stop.is_set():
            self._watcher = self._thread(self._watch, "membership", generation, error)

    def wait_reconnected(self, generation: int, timeout: float = RECONNECT_WITHIN) -> bool:
        """Block until a reconnection after `generation` (True), or `timeout` passed (False)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self.generation > generation or self._stop.is_set(), timeout) \
                and self.generation > generation

    def remove_listener(self, listener: EpochListener) -> None:
        with self._changed:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def wait_for_epoch_after(self, epoch: int, timeout: float) -> int:
        """Block until an epoch newer than `epoch` is known; return it or raise MembershipTimeout."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._epoch > epoch, timeout):
                raise MembershipTimeout(f"rank {self.rank}: no membership epoch after {epoch} "
                                        f"within {timeout:g}s")
            return self._epoch

    # --- telling the coordinator ------------------------------------------------------------
    def mark(self, where: str, iteration: int | None = None, microbatch: int | None = None) -> None:
        """Where this rank is, for the next heartbeat (no store operation): call it at every
        step that may take long and before every wait."""
        self._progress.mark(self._epoch, where, iteration, microbatch)

    def close(self, leave: bool = True) -> None:
        """Stop both background threads (returns within about one heartbeat interval). With
        `leave` (the default) the coordinator is told first, so the silence that follows is not
        taken for a hang; leave=False just goes silent, as a vanished process would."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._changed:
            self._changed.notify_all()  # a heartbeat thread waiting for a reconnection ends
        def goodbye() -> None:  # bounded: a cut link answers nothing (and locks its client)
            if leave:
                self.leave()
            self.store.queue_push(P.notify_key(self.rank), P.STOP)  # ends the watcher's pop
        with contextlib.suppress(RuntimeError):  # the coordinator is gone: nothing to tell
            self._bounded(goodbye)
        self._bounded.close()
        self.store.close()
        for thread in (self._watcher, self._beater):  # (a watcher left on a cut link: not)
            if thread is not threading.current_thread():
                thread.join(self.heartbeat_interval + 5.0)

    # --- the background threads -------------------------------------------------------------
    def _beat_once(self) -> None:
        self._beats += 1
        beat = f"{self._beats} {self._progress.line()}"
        if self._node_beats is not None:  # a file on the node; its launcher forwards it
            write_beat(self._node_beats.directory, self.rank, self.heartbeat_interval, beat)
        else:
            assert self._beat_store is not None
            self._beat_store.set(P.heartbeat_key(self.rank), beat)

    def _beat(self) -> None:
        while not self._stop.wait(self._beat_every):
            generation = self.generation
            self._follow_a_moved_coordinator(generation)
            try:
                self._beat_once()
            except OSError:  # the node's directory is gone: this rank falls silent, as it must
                pass
            except RuntimeError:  # the watcher reconnects; beat on the new connection
                if not self.wait_reconnected(generation):
                    return

    def _follow_a_moved_coordinator(self, generation: int) -> None:
        """The node's address file names another coordinator (etcd elected a successor). Over
        a cut link the old connections never fail: a new watcher reconnects now."""
        if self._address_file is None or self._moved_seen == generation:
            return
        moved_to = P.current_address(self._address_file, *self._address[:2])
        if moved_to != self._connected_to:
            self._moved_seen = generation
            self._watcher = self._thread(self._watch, "membership", generation, RuntimeError(
                f"the coordinator moved to {moved_to[0]}:{moved_to[1]}"))

    def _watch(self, generation: int, lost: Exception | None = None) -> None:
        """Serve one connection generation (after registering again first, if `lost` says why);
        once another thread reconnected, end without acting on what the old connection returns."""
        if lost is not None:
            if not self._reconnect(lost, generation):
                return
            generation = self.generation
        store = self._watch_store
        while not self._stop.is_set():
            try:
                value = store.queue_pop(P.notify_key(self.rank), True)
                if generation != self.generation:  # superseded on a coordinator still alive:
                    store.queue_push(P.notify_key(self.rank), value.decode())  # the new one's news
                    return
                if value == P.STOP.encode():
                    return
                self._adopt(*P.read_latest(store))
            except RuntimeError as e:
                if self._stop.is_set() or generation != self.generation \
                        or not self._reconnect(e, generation):
                    return
                generation, store = self.generation, self._watch_store

    def _reconnect(self, error: Exception, generation: int) -> bool:
        """Register with the successor, bringing this rank's latest epoch record and a spare's
        wait. True iff this thread did: it then watches (two pops on one client deadlock)."""
        with self._reconnecting:
            return self.generation == generation and self._register_again(error)

    def _register_again(self, error: Exception) -> bool:
        logger.warning(f"lost the coordinator ({str(error)[:80]}); reconnecting")
        deadline = time.monotonic() + RECONNECT_WITHIN
        while not self._stop.is_set():
            try:
                previous = self.store
                self._open(5.0, {"epoch": self._epoch, "record": self._record}, attempt=1.0)
                previous.close()  # its bound's worker (perhaps stuck on a cut link: abandoned)
                for listener in list(self._on_reconnect):  # before anyone retries on it
                    listener(self.store)
                break
            except JobTokenRefused as refused:  # declared dead meanwhile: fenced
                logger.error(f"{refused}: exiting")
                os._exit(1)
            except (CoordinatorUnreachable, RuntimeError) as e:
                if time.monotonic() > deadline:
                    if not self._stop.is_set():
                        logger.error(f"lost the coordinator: {e}")
                    return False
                time.sleep(0.1)
        with self._changed:
            self.generation += 1
            self._changed.notify_all()
        if self._spare_slots is not None:
            self.wait_as_spare(self._spare_slots)
        self._adopt(*P.read_latest(self._watch_store))
        logger.info("reconnected to the coordinator")
        return True

    def _adopt(self, epoch: int, dead: frozenset[int], record: dict) -> None:
        with self._changed:
            if epoch <= self._epoch:
                return
            self._epoch, self._dead, self._record = epoch, dead, record
            if self.rank in record.get("joining", ()):
                self._spare_slots = None  # a member again
            listeners = list(self._listeners)
            self._changed.notify_all()
        for listener in listeners:
            listener(epoch, dead)
        # an epoch names the incarnation it declares dead: a replacement waiting for the dead
        # slot it took over is not the one fenced
        taken = record.get("joining_incarnations", {}).get(str(self.rank), self.incarnation)
        if (self.rank in dead and P.dead_incarnations(record)[self.rank] >= self.incarnation) \
                or taken != self.incarnation:  # another process of this slot re-forms its replica
            # Fenced: the job moved on without us. Going on could only corrupt its state.
            logger.error(f"rank {self.rank} was declared dead in epoch {epoch}: exiting")
            stacks.of_self(f"rank {self.rank}, declared dead")
            os._exit(1)
