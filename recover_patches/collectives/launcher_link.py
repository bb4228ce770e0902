"""The launcher's side of the coordinator: start it (node 0) or join it, report exits, fence.

Kept out of `launch.py` so that the launcher imports torch only when a coordinator is used.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from argparse import Namespace
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.bounded_call import BoundedCaller
from recover_patches.collectives.counted_store import CountedStore, OpCounter
from recover_patches.collectives.epoch_watch import EpochWatch
from recover_patches.collectives.errors import CoordinatorConfigError, CoordinatorError
from recover_patches.collectives.journal import Journal
from recover_patches.collectives.node_beats import NodeBeatRelay, RankAges, format_line
from recover_patches.collectives.timeouts import OPERATION_WAIT, RECONNECT_WITHIN

logger = logging.getLogger(__name__)

START_TIMEOUT = 30.0
STANDBY_LINGER = 2.0  # seconds the coordinator outlives the job when standby nodes took part


class LauncherLink:
    """A launcher's connection. If the coordinator disappears, the link says so and tries to
    reconnect (a restarted coordinator listens on the same port; an elected one where the node's
    address file says, which also moves the link at once) at most once a second, for
    RECONNECT_WITHIN seconds; the launcher keeps supervising its ranks either way. Every
    operation is given up after OPERATION_WAIT (`bounded_call.py`): a cut link must not stall
    the supervision loop.
    `answered_at`: when the coordinator at `connected_to` (host, port) last answered."""

    def __init__(self, host: str, port: int, token: str, node_rank: int,
                 address_file: Path | None = None, relay: NodeBeatRelay | None = None):
        self._address = (host, port, token, node_rank)
        # the node's beats: its name, and the ranks each epoch is passed on to
        self._node = relay.node if relay is not None else str(node_rank)
        self._relay: Callable[[], Iterable[int]] = (lambda: relay.ranks) if relay is not None \
            else tuple
        self._address_file = address_file  # the elected coordinator's (etcd), re-read to connect
        self.ops = OpCounter()  # every operation on the coordinator's store, the watch's too
        self._bounded = BoundedCaller(OPERATION_WAIT, "recover-link-op")
        self.store = self._connect(START_TIMEOUT)
        self.answered_at = time.monotonic()
        self.broken = False
        self._lost_at: float | None = None  # when the connection broke, while reconnecting
        self._retry_at = 0.0
        self._epoch = -1
        self._dead: dict[int, int] = {}  # dead rank -> the incarnation declared dead
        self.stopped: str | None = None  # why the coordinator stopped the job, once read
        self._assigned_count = 0  # assignments to standby processes seen so far
        self._news = threading.Event()  # every watch's, the abandoned ones' too
        self._watch = self._new_watch()

    def _connect(self, timeout: float, wait: timedelta | None = None) -> CountedStore:
        """`wait`: how long its blocking operations wait (the connection timeout otherwise)."""
        host, port, token, node_rank = self._address
        host, port = P.current_address(self._address_file, host, port)
        raw = P.connect(host, port, timeout, "the launcher")
        P.handshake(raw, token, "launcher", node_rank, timeout, node=self._node)
        if wait is not None:
            raw.set_timeout(wait)
        else:
            self.connected_to = (host, port)
        return CountedStore(dist.PrefixStore(P.job_prefix(token), raw), self.ops)

    def _new_watch(self) -> EpochWatch:
        return EpochWatch(lambda wait: self._connect(5.0, wait), self._node, self._news,
                          self._relay)

    def close(self) -> None:
        """Stop the epoch watch (the launcher is done with the coordinator). Bounded: the store's
        client is locked while an abandoned operation waits on it (`bounded_call.py`)."""
        try:
            self._bounded(lambda: self._watch.close(self.store), limit=OPERATION_WAIT + 5.0)
        except RuntimeError:
            pass  # a cut link: the watch is a daemon thread, it ends with the launcher
        self._bounded.close()

    def _guard(self, action, default):
        if self._lost_at is None and self._moved():
            self._lost_at = self._retry_at = time.monotonic()
        if self.broken or (self._lost_at is not None and not self._reconnected()):
            return default
        try:
            result = self._bounded(action)
        except RuntimeError as e:
            self._lost_at, self._retry_at = time.monotonic(), time.monotonic() + 0.5
            logger.warning(f"lost the coordinator ({str(e)[:80]}); reconnecting")
            return default
        self.answered_at = time.monotonic()
        return result

    def _moved(self) -> bool:
        """etcd elected a coordinator elsewhere (the old one may be cut off, not closed)."""
        host, port, _, _ = self._address
        return self._address_file is not None and \
            P.current_address(self._address_file, host, port) != self.connected_to

    def _reconnected(self) -> bool:
        assert self._lost_at is not None
        if time.monotonic() < self._retry_at:
            return False
        try:
            self.store = self._bounded(lambda: self._connect(1.0), limit=1.0 + OPERATION_WAIT)
        except (CoordinatorError, RuntimeError) as e:
            self._retry_at = time.monotonic() + 1.0
            if time.monotonic() - self._lost_at > RECONNECT_WITHIN:
                self.broken = True
                logger.warning(f"the coordinator did not come back ({e}); supervising without it")
            return False
        self._lost_at, self._epoch = None, -1
        self._assigned_count = 0  # a successor counts its own assignments
        self.answered_at = time.monotonic()
        self._watch.abandon()  # its pop may wait on a cut link: a new watch, on the successor
        self._watch = self._new_watch()
        logger.info("reconnected to the coordinator")
        return True

    def report_exit(self, rank: int, code: int, incarnation: int = 0,
                    replacing: bool = False) -> None:
        self._guard(lambda: P.post_report(self.store, P.Report.make(
            "exit", rank=rank, code=code, incarnation=incarnation, replacing=replacing)), None)

    def forward_beats(self, node: str, beats: dict[int, RankAges]) -> None:
        """This node's live ranks' heartbeats as one line appended to its shard (`node_beats.py`),
        then a check of that key: TCPStore answers neither set nor append, so over a cut link
        they never fail; the check's answer is the node's proof of contact (and says the line
        before it arrived)."""
        key, line = P.node_beats_key(node), format_line(node, beats)

        def write() -> None:
            self.store.append(key, line)
            self.store.check([key])
        self._guard(write, None)

    def report_standby_exit(self, standby: str) -> None:
        self._guard(lambda: P.post_report(self.store, P.Report.make("standby_exit", id=standby)),
                    None)

    def assignments(self, standbys: list[str]) -> dict[str, tuple[int, int]]:
        """The slots (rank, incarnation) the coordinator gave to any of `standbys`; one store
        operation unless an assignment happened since the last call."""
        def read():
            count = self.store.add(P.ASSIGNED_COUNT, 0)
            if count == self._assigned_count:
                return {}
            found = {}
            for standby in standbys:
                if self.store.check([P.assigned_key(standby)]):
                    slot = json.loads(self.store.get(P.assigned_key(standby)))
                    found[standby] = (int(slot["rank"]), int(slot["incarnation"]))
            self._assigned_count = count  # the coordinator writes the key before the count
            return found
        return self._guard(read, {})

    def dead_incarnations(self) -> dict[int, int]:
        """Dead ranks of the latest epoch, each with the incarnation declared dead; read from the
        store only once the epoch watch saw a newer epoch land (or lost its connection)."""
        if not self._watch.news.is_set():
            return self._dead
        self._watch.news.clear()

        def read():
            epoch = int(self.store.get(P.EPOCH))  # written after the push's record
            if epoch != self._epoch:
                self._dead = P.dead_incarnations(json.loads(self.store.get(P.epoch_key(epoch))))
                self._epoch = epoch
            if self._watch.job_stopped and self.stopped is None:
                self.stopped = self.store.get(P.STOPPED).decode()
            return True
        if not self._guard(read, False):  # not read (the coordinator is away): next time
            self._watch.news.set()
        return self._dead

    def dead_ranks(self) -> frozenset[int]:
        return frozenset(self.dead_incarnations())

    def completion(self) -> tuple[int, frozenset[int]] | None:
        def read():
            if not self.store.check([P.COMPLETE]):
                return None
            record = json.loads(self.store.get(P.COMPLETE))
            return record["epoch"], frozenset(record["dead"])
        return self._guard(read, None)

    def finished(self, lost: str | None = "1") -> str | None:
        """FINISHED's value once the coordinator set it (while the link is lost: `lost`)."""
        def read():
            return self.store.get(P.FINISHED).decode() if self.store.check([P.FINISHED]) else None
        return self._guard(read, lost)

    def stop_reason(self) -> str | None:
        """Why the coordinator stopped the job (None: it did not), asked now."""
        def read():
            if self.stopped is None and self.store.check([P.STOPPED]):
                self.stopped = self.store.get(P.STOPPED).decode()
            return self.stopped
        return self._guard(read, self.stopped)


class CoordinatorHandle:
    """Where the coordinator is, and its process if this launcher started it (then it starts a
    successor on the same port if that process dies: `restart_if_dead`)."""

    def __init__(self, host: str, port: int, token: str, node_rank: int, nnodes: int,
                 pid: int | None, world_size: int = 0):
        self.host, self.port, self.token = host, port, token
        self.node_rank, self.nnodes, self.pid = node_rank, nnodes, pid
        self.world_size = world_size
        self.restarts = 0

    def restart_if_dead(self) -> None:
        if self.pid is None or os.waitpid(self.pid, os.WNOHANG)[0] == 0:
            return
        logger.warning(f"the coordinator (pid {self.pid}) died: starting a new one on port {self.port}")
        self.pid, _ = fork_coordinator(self.port, self.token, self.world_size, restarted=True)
        self.restarts += 1

    def self_fence(self, link: LauncherLink | None, limit: float, fence: Callable[[str], None]):
        """None: with the static rendezvous there is no majority for a node to be cut off from
        (`self_fence.py`; the elected coordinator's handle returns one)."""
        return None

    def env(self) -> dict[str, str]:
        return {"RECOVER_COORDINATOR": f"{self.host}:{self.port}", "RECOVER_JOB_TOKEN": self.token}

    def connect(self, relay: NodeBeatRelay | None = None) -> LauncherLink:
        return LauncherLink(self.host, self.port, self.token, self.node_rank, relay=relay)

    def finish(self, link: LauncherLink | None, should_stop=lambda: False
               ) -> tuple[int, frozenset[int]] | None:
        """After this node's ranks are done: read the completion record; if we own the
        coordinator, keep it up until every rank and every standby process sent home is done
        (other nodes, standby nodes), then stop it."""
        if self.pid is not None and link is not None:  # (standby nodes: with one node too)
            # while our coordinator lives, a lost link is a reconnection away (to the successor
            # this node just started, under etcd), not the job's end: leaving then took the
            # job's only coordinator away from every other launcher
            while (finished := link.finished(None if self._coordinator_lives() else "1")) \
                    is None and not should_stop():
                time.sleep(0.1)
            if finished == P.FINISHED_WITH_STANDBYS:  # their launchers read the end last
                time.sleep(STANDBY_LINGER)
        completion = link.completion() if link is not None else None
        if link is not None:
            if completion is None:  # a stop that came while we waited: kept in `link.stopped`
                link.stop_reason()
            link.close()
        if self.pid is not None:
            stop_process(self.pid, grace=5.0)
        return completion

    def _coordinator_lives(self) -> bool:
        """Whether the coordinator process this launcher started still runs (one that ended is
        reaped here, and forgotten)."""
        try:
            if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] != 0:
                self.pid = None
        except ChildProcessError:  # reaped already
            self.pid = None
        return self.pid is not None


def stop_process(pid: int, grace: float) -> None:
    """Stop a coordinator this launcher started (it ignores SIGTERM: see coordinator.run)."""
    from recover_patches.collectives.coordinator import OWNER_STOP
    try:
        os.kill(pid, OWNER_STOP)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] != 0:
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def fork_coordinator(port: int, token: str, world_size: int, restarted: bool = False,
                     journal: Callable[[], Journal] | None = None) -> tuple[int, int]:
    """Fork the coordinator process; return (pid, port it listens on). Its waits follow the ranks'
    --recover-timeout, which the first rank to register brings. `journal` makes the elected
    coordinator's journal in the child (its own etcd connections: none shared across the fork)."""
    from recover_patches.collectives.coordinator import CoordinatorConfig, run, start_server

    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the coordinator process: never returns
        code = 0
        try:
            os.close(read_fd)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            server = start_server("0.0.0.0", port)
            os.write(write_fd, f"{server.port}\n".encode())
            os.close(write_fd)
            run(server, CoordinatorConfig(world_size, token, restarted=restarted,
                                          journal=journal() if journal else None),
                linger=None, owned=True)
        except BaseException as e:
            traceback.print_exc()
            try:
                os.write(write_fd, f"error {e}\n".encode())
            except OSError:
                pass
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], START_TIMEOUT)
        line = os.read(read_fd, 4096).decode().strip() if ready else "error: no answer"
    finally:
        os.close(read_fd)
    if not line.isdigit():
        stop_process(pid, grace=1.0)
        raise CoordinatorConfigError(f"the coordinator could not listen on --coordinator-port {port} "
                                     f"({line}); pick a free port or 0")
    return pid, int(line)


def start_or_join_coordinator(args: Namespace, token: str) -> CoordinatorHandle:
    """Node 0 starts the coordinator unless RECOVER_COORDINATOR points to one already."""
    world_size = args.nnodes * args.nproc_per_node
    if os.environ.get("RECOVER_COORDINATOR"):
        host, port = P.parse_address(os.environ["RECOVER_COORDINATOR"], "RECOVER_COORDINATOR")
        return CoordinatorHandle(host, port, token, args.node_rank, args.nnodes, None)
    if args.node_rank != 0 or args.standby:
        return CoordinatorHandle(args.master_addr, args.coordinator_port, token, args.node_rank,
                                 args.nnodes, None)
    pid, port = fork_coordinator(args.coordinator_port, token, world_size)
    return CoordinatorHandle(args.master_addr, port, token, 0, args.nnodes, pid, world_size)
